# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 3. MXFP4 weights: the e2m1 grid, E8M0 scales, and the decoder's legal range
#
# Expert weights are MXFP4: a 4-bit e2m1 code per value and one E8M0 (power-of-two) scale byte per
# 32 values along K. Hopper has no FP4 tensor cores, so the SM90 kernels *decode* each value to e4m3
# with its scale folded in, then run an FP8 MMA. That decode has a legal range; outside it the kernel
# silently corrupts the output. This notebook measures each piece with `megamoe.formats`.
#
# Ladder: (3.1) the e2m1 grid, (3.2) E8M0 scales of real-like weights and the quantization error,
# (3.3) the decoders' legal range, and DeepGEMM's decode table as the H200 runs it, (3.4) what an
# out-of-range scale does to the layer, and the repair, (3.5) megamoe's own tensor-core decode: the scale
# kept out of the e4m3 value, and the byte order that feeds the MMA straight from a load.

# %%
import json

import torch
import matplotlib.pyplot as plt

from megamoe import calc_diff, get_geometry, random_mxfp4_weights
from megamoe.formats import (
    E2M1_MAGNITUDES, dequantize_mxfp4, e2m1_decode, e2m1_encode,
    e4m3_flush_saturate, e4m3_satfinite, e8m0_to_float, quantize_mxfp4,
)
from megamoe.palette import backend_colour
from megamoe.inputs import make_inputs
from megamoe.recipe import DEEPGEMM_SM90_FP4, FLASHINFER_MXFP4
from megamoe.reference import moe_forward
from megamoe.testing import rel_l2
from megamoe.weights import MXFP4Weights, random_dense_expert

from _nb import Figures, cited

figs = Figures("03_mxfp4_weights")

# %% [markdown]
# ## 3.1 The e2m1 grid
#
# 16 codes: a sign bit and 8 magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}, so 15 distinct values. Rounding
# is to nearest, ties to the even code. The grid is coarse: the worst relative rounding error
# between 0.5 and 6 is measured below.

# %%
codes = torch.arange(16, dtype=torch.uint8)
values = e2m1_decode(codes)
print("code -> value:", {int(c): float(v) for c, v in zip(codes, values)})
print(f"distinct values: {values.unique().numel()}")
grid = torch.linspace(-7, 7, 14001)
rounded = e2m1_decode(e2m1_encode(grid))
band = (grid.abs() >= 0.5) & (grid.abs() <= 6)
worst = ((rounded - grid).abs() / grid.abs())[band].max()
print(f"worst relative rounding error for 0.5 <= |w| <= 6: {worst:.3f}")

# %%
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 3.6))
ax0.plot(grid.numpy(), rounded.numpy(), lw=1.5)
ax0.plot(grid.numpy(), grid.clamp(-6, 6).numpy(), "k:", lw=0.8)
ax0.set(xlabel="w / scale", ylabel="e2m1 value", title="e2m1 rounding (RNE, saturating at +-6)")
ax1.stem(values.numpy(), torch.ones(16).numpy(), basefmt=" ")
for c, v in zip(codes.tolist(), values.tolist()):
    ax1.text(v, 1.05 + 0.12 * (c >= 8), f"{c}", ha="center", fontsize=7)
ax1.set(ylim=(0, 1.4), yticks=[], xlabel="value", title="the 16 codes (label = 4-bit code; 8 = -0)")
figs.save(fig, "e2m1_grid")

# %% [markdown]
# ## 3.2 E8M0 scales and the quantization error
#
# Each group of 32 values gets the smallest power of two `s` with `amax / s <= 6`, stored as byte
# `127 + log2 s`. We quantize one expert drawn at the real DeepSeek-V4-Flash size (Gaussian, std
# 1/sqrt(K), rows spread over 2 octaves as in real checkpoints; its first 512 rows of each tensor, which
# have the same statistics and keep the notebook fast) and look at the bytes. FlashInfer's decoder
# decodes bytes 122..133 (2^-5 .. 2^6) exactly for groups with nonzero codes, DeepGEMM SM90 FP4's
# 119..133 (2^-8 .. 2^6): each window is derived from the decoder's rule (the bytes under which all
# 16 e2m1 codes decode exactly, `megamoe.formats.scale_byte_window`), and DeepGEMM's was measured on the
# H200 for every byte and code (3.3). Byte 0xFF is NaN, never a scale.

# %%
flash = get_geometry("dsv4-flash")
w1, w2 = random_dense_expert(flash, gen=torch.Generator().manual_seed(0))  # [2I, H], [H, I] fp32
w1, w2 = w1[:512], w2[:512]  # row subsets: same per-group statistics (K = H for L1, I for L2)
(l1_q, l1_s), (l2_q, l2_s) = quantize_mxfp4(w1), quantize_mxfp4(w2)  # packed e2m1, E8M0 bytes
l1_bytes, l2_bytes = l1_s.flatten(), l2_s.flatten()
lo, hi = FLASHINFER_MXFP4.min_scale_byte, FLASHINFER_MXFP4.max_scale_byte
below = (torch.cat([l1_bytes, l2_bytes]) < lo).float().mean()
err_l1 = rel_l2(dequantize_mxfp4(l1_q, l1_s), w1)
err_l2 = rel_l2(dequantize_mxfp4(l2_q, l2_s), w2)
print(f"L1 scale bytes {int(l1_bytes.min())}..{int(l1_bytes.max())}, L2 {int(l2_bytes.min())}..{int(l2_bytes.max())}; "
      f"FlashInfer legal {lo}..{hi}")
print(f"groups below FlashInfer's legal range: {below:.1%}")
print(f"MXFP4 quantization error: rel_l2 L1 {err_l1:.4f}, L2 {err_l2:.4f}")

# %%
fig, ax = plt.subplots(figsize=(8, 3.8))
bins = torch.arange(112, 140)
for name, b in (("L1 (gate|up)", l1_bytes), ("L2 (down)", l2_bytes)):
    ax.bar(bins.numpy() + (0.2 if name.startswith("L2") else -0.2),
           torch.bincount(b.long(), minlength=140)[112:140].numpy() / b.numel(), width=0.4, label=name)
ax.axvspan(lo - 0.5, hi + 0.5, color="tab:green", alpha=0.12, label=f"FlashInfer legal {lo}..{hi}")
ax.set(xlabel="E8M0 scale byte (127 = 2^0)", ylabel="fraction of groups",
       title="scale bytes of one DeepSeek-V4-Flash-sized expert")
ax.legend()
figs.save(fig, "scale_bytes")

# %% [markdown]
# ## 3.3 The decoders' legal range
#
# The decoded value is `e2m1 * 2^(b - 127)`, written as e4m3. FlashInfer's SM90 decoder keeps it
# exact when 2^-6 <= |v| <= 448, flushes smaller values to 0 (no subnormals) and saturates larger ones
# to 448 (`e4m3_flush_saturate`). DeepGEMM's table keeps e4m3 subnormals (down to 2^-9,
# `e4m3_satfinite`) and wraps for scales >= 2^7 (not modelled: the recipe refuses those bytes; the
# table as the H200 decodes it is below). Below: each e2m1 magnitude's decoded / exact ratio over the
# scale byte.

# %%
scale_bytes = torch.arange(112, 142, dtype=torch.uint8)
scale = e8m0_to_float(scale_bytes)  # [S]
mags = torch.tensor(E2M1_MAGNITUDES[1:])  # [7] nonzero magnitudes
exact = mags[:, None] * scale[None, :]  # [7, S]
ratio_fi = e4m3_flush_saturate(exact).float() / exact
ratio_dg = e4m3_satfinite(exact).float() / exact
legal = (scale_bytes >= lo) & (scale_bytes <= hi)
print("every nonzero magnitude decodes exactly inside FlashInfer's legal bytes:",
      bool((ratio_fi[:, legal] == 1).all()))
# Flushes on the real-like expert at its raw scales:
raw = torch.cat([dequantize_mxfp4(l1_q, l1_s).flatten(), dequantize_mxfp4(l2_q, l2_s).flatten()])
nonzero = raw != 0
flushed = (e4m3_flush_saturate(raw).float() == 0) & nonzero
print(f"raw scales, FlashInfer decoder: {flushed.sum() / nonzero.sum():.1%} of nonzero weights flush to 0, "
      f"rel_l2 of decoded weights {rel_l2(e4m3_flush_saturate(raw).float(), raw):.3f}")
print(f"raw scales, DeepGEMM decoder (subnormals kept): "
      f"rel_l2 {rel_l2(e4m3_satfinite(raw).float(), raw):.4f}")

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 3.8), sharey=True)
for ax, ratio, recipe, title in ((axes[0], ratio_fi, FLASHINFER_MXFP4, "FlashInfer SM90: flush < 2^-6, saturate > 448"),
                                 (axes[1], ratio_dg, DEEPGEMM_SM90_FP4, "DeepGEMM SM90 FP4: e4m3 with subnormals")):
    for m, row in zip(mags.tolist(), ratio):
        ax.plot(scale_bytes.numpy(), row.numpy(), marker=".", label=f"|e2m1| = {m:g}")
    r_lo = recipe.min_scale_byte if recipe.min_scale_byte is not None else int(scale_bytes[0])
    ax.axvspan(r_lo - 0.5, recipe.max_scale_byte + 0.5, color="tab:green", alpha=0.12, label="recipe's legal bytes")
    ax.set(xlabel="E8M0 scale byte", title=title)
axes[1].axvspan(127 + 6.5, 141.5, color="tab:red", alpha=0.12)
axes[1].text(137.5, 1.25, "scale >= 2^7: wraps\n(not modelled)", ha="center", fontsize=8)
axes[0].set(ylabel="decoded / exact")
axes[0].legend(fontsize=7, ncol=2)
figs.save(fig, "decoder_range")

# %% [markdown]
# DeepGEMM's SM90 FP4 kernel does this decode with a constant table (scale byte x code -> e4m3 byte).
# The table as the H200 runs it was read back for all 256 bytes x 16 codes through a crafted layer
# (`megamoe.layouts.fp4_window.decode_probe_layer`: each output element is 0.75 x one decoded weight,
# exact in bf16) and committed with the kernel's H200 results (`bench/results/CITED.json` names the
# folder). Plotted as it was recorded: per scale byte, how many of the 16 codes the kernel decodes to
# the exact value e2m1 x 2^(b-127), and how many to the e4m3 round-to-nearest of it (the recipe's
# `e4m3_rn`, what the reference models).

# %%
lut = json.loads((cited("deepgemm_fp4") / "probe-lut-checkpoint.json").read_text())["lut"]
kernel = torch.tensor([[float("nan") if v is None else v for v in row] for row in lut["kernel_table"]])  # [256 bytes, 16 codes]
all_bytes_u8 = torch.arange(256, dtype=torch.uint8)
exact_table = e2m1_decode(torch.arange(16, dtype=torch.uint8))[None, :] * e8m0_to_float(all_bytes_u8)[:, None]  # byte 255: NaN


def same(a, b):
    return (a == b) | (a.isnan() & b.isnan())


n_exact = same(kernel, exact_table).sum(1)  # [256] codes decoded exactly
n_rn = same(kernel, e4m3_satfinite(exact_table).float()).sum(1)  # [256] codes equal to the recipe's model
assert [b for b in range(256) if n_exact[b] == 16] == lut["bytes_all_codes_exact"]  # what the probe reported
assert [b for b in range(256) if n_rn[b] == 16] == lut["bytes_matching_e4m3_rn_model"]
w_lo, w_hi = lut["window_measured"]
print(f"every code exact for scale bytes {w_lo}..{w_hi} (the recipe's legal bytes: "
      f"{DEEPGEMM_SM90_FP4.min_scale_byte}..{DEEPGEMM_SM90_FP4.max_scale_byte})")
print(f"kernel = e4m3 RN of the exact value for bytes {min(lut['bytes_matching_e4m3_rn_model'])}.."
      f"{max(lut['bytes_matching_e4m3_rn_model'])}; all 16 codes decode to 0 for bytes "
      f"{min(lut['all_zero_bytes'])}..{max(lut['all_zero_bytes'])}")
print("codes exact per byte around the window:", {b: int(n_exact[b]) for b in range(112, 140)})
print(f"byte 255 (E8M0 NaN) decodes to finite values: {bool(torch.isfinite(kernel[255]).all())}")

# %%
fig, axes = plt.subplots(1, 2, figsize=(13, 3.8), gridspec_kw={"width_ratios": [1.4, 1]})
dg_colour, model_colour = backend_colour("deepgemm-sm90-fp4"), backend_colour("reference")
for ax, (b0, b1) in zip(axes, ((0, 256), (108, 146))):
    bb = torch.arange(b0, b1)
    ax.bar(bb.numpy(), n_exact[b0:b1].numpy(), width=1.0, color=dg_colour, label="kernel = exact e2m1 x 2^(b-127)")
    ax.step(bb.numpy(), n_rn[b0:b1].numpy(), where="mid", color=model_colour, lw=1.8, ls="--", zorder=3,
            label="kernel = e4m3 RN of exact (recipe's model)")
    ax.axvspan(w_lo - 0.5, w_hi + 0.5, color=dg_colour, alpha=0.15, label=f"exact window {w_lo}..{w_hi}")
    ax.set(xlim=(b0 - 0.5, b1 - 0.5), ylim=(0, 17), xlabel="E8M0 scale byte (127 = 2^0)", ylabel="codes of 16")
axes[0].set_title("DeepGEMM SM90 FP4 decode table, measured on the H200: all 256 bytes")
axes[1].set_title("around the window")
axes[0].legend(fontsize=7, loc="center right")
figs.save(fig, "decode_table_measured")

# %% [markdown]
# ## 3.4 What an out-of-range scale does to the layer, and the repair
#
# The kernels do not check the range: raw checkpoint-like scales run, and give a wrong answer. We run
# the whole layer (small preset) with each kernel's recipe against the exact reference. The library's
# repair (`megamoe.layouts.ranges.repair_ranges`) moves the excess exponent into FlashInfer's
# per-expert global scales (`gs1`, `gs2`, applied to the FP32 accumulators), which leaves every value
# unchanged but puts the per-32 bytes inside the decoder's range.

# %%
g = get_geometry("small")
weights = random_mxfp4_weights(g, seed=3)
inp = make_inputs(g, 32, seed=4)
ref = moe_forward(inp, weights, "exact", g)
all_bytes = torch.cat([weights.l1_scale.flatten(), weights.l2_scale.flatten()])
print(f"small preset raw scale bytes {int(all_bytes.min())}..{int(all_bytes.max())} "
      f"({(all_bytes < lo).float().mean():.1%} below FlashInfer's {lo})")
results = {}
results["FlashInfer, raw scales"] = calc_diff(moe_forward(inp, weights, FLASHINFER_MXFP4, g), ref)
results["DeepGEMM FP4, raw scales"] = calc_diff(moe_forward(inp, weights, DEEPGEMM_SM90_FP4, g), ref)
# Expert 0's L2 scales made 2^12 larger (a checkpoint with a global scale folded into the bytes):
# same codes, 4096x larger values, still a valid MXFP4 tensor, but above the top byte 133.
hot = MXFP4Weights(weights.l1, weights.l1_scale, weights.l2, weights.l2_scale.clone())
hot.l2_scale[0] += 12
ref_hot = moe_forward(inp, hot, "exact", g)
results[f"FlashInfer, expert 0 L2 x2^12 (max byte {int(hot.l2_scale[0].max())})"] = calc_diff(
    moe_forward(inp, hot, FLASHINFER_MXFP4, g), ref_hot)
try:
    from megamoe.layouts.ranges import analyze_ranges, repair_ranges
except ImportError:
    repair_ranges = None
    print("megamoe.layouts.ranges is not available yet in this checkout: the repaired rows are skipped.")
if repair_ranges is not None:
    report = analyze_ranges(weights, FLASHINFER_MXFP4)
    print("\n".join(str(report).splitlines()[:4]) + "\n  ...")
    print(f"range check: ok={report.ok}, {len(report.bad())} tensors / {report.out_of_range} nonzero groups out of range")
    print("after repair:", analyze_ranges(repair_ranges(weights, FLASHINFER_MXFP4), FLASHINFER_MXFP4).ok)
    fixed = repair_ranges(weights, FLASHINFER_MXFP4)
    results["FlashInfer, repaired"] = calc_diff(moe_forward(inp, fixed, FLASHINFER_MXFP4, g), ref)
    results["FlashInfer, x2^12 expert repaired"] = calc_diff(
        moe_forward(inp, repair_ranges(hot, FLASHINFER_MXFP4), FLASHINFER_MXFP4, g), ref_hot)
for k, v in results.items():
    print(f"{k:34s} calc_diff vs exact = {v:.2e}")

# %%
fig, ax = plt.subplots(figsize=(8, 3.8))
names = list(results)
# Each bar in its backend's colour (megamoe.palette); the raw, out-of-range scales hatched.
colors = [backend_colour("flashinfer-mxfp4" if n.startswith("FlashInfer") else "deepgemm-sm90-fp4") for n in names]
bars = ax.barh(names, list(results.values()), color=colors)
for bar, n in zip(bars, names):
    bar.set_hatch("" if "repaired" in n else "//")
ax.set(xscale="log", xlabel="calc_diff vs the exact reference (lower is better)",
       title="whole layer, small preset: in range vs out of range")
ax.invert_yaxis()
figs.save(fig, "layer_error_by_range")

# %% [markdown]
# **Takeaway.** MXFP4 itself costs ~10% relative error per weight (the e2m1 grid is that coarse);
# the decoder's range costs nothing *if* the scales are inside it, and a lot if not, silently. Detect
# with `analyze_ranges`, repair with `repair_ranges`, before any kernel reads the weights.

# %% [markdown]
# ## 3.5 A decode that keeps the scale out: `megamoe-decode-tc`
#
# The decoders above fold the scale into the e4m3 value, which is why they have a narrow legal range.
# megamoe's tensor-core decode kernel (`megamoe/decode/triton_tc.py`) does not: it places the e2m1 code's four
# bits into an e4m3 byte (`s e1 e0 m` -> `s 00 e1 e0 m 00`), which is worth e2m1 x 2^-6 for all 16 codes (the
# e2m1 subnormal 0.5 lands on the e4m3 subnormal 2^-7), runs a fresh FP8 MMA per 32-K group, and multiplies the
# group's FP32 sum by 2^(s - 121). That product is exact for every byte that keeps four scaled group sums normal
# and finite: 20..236, 217 bytes against DeepGEMM's 15.

# %%
from megamoe.decode.layout_tc import code_blocks, e4m3_bytes
from megamoe.formats import pack_e2m1, scale_byte_window

codes = torch.arange(16, dtype=torch.uint8)
as_e4m3 = e4m3_bytes(codes)
vals = as_e4m3.view(torch.float8_e4m3fn).double() * 2.0**6
print("code  e4m3 byte  value * 2^6  e2m1")
for c, b, v, want in zip(codes.tolist(), as_e4m3.tolist(), vals.tolist(), e2m1_decode(codes).tolist()):
    print(f"{c:4d}  0x{b:02x}       {v:+6.2f}       {want:+5.1f}")
assert torch.equal(vals, e2m1_decode(codes).double())
print("legal scale bytes of the tensor-core decode:", scale_byte_window("e4m3_group"))

# %% [markdown]
# Where each weight of one (tile, group) block lives: the kernel loads 8 bytes per thread and hands them to the
# MMA without moving them, because the block's bytes are stored in the order of the wgmma A fragment
# (`megamoe/decode/layout_tc.py`). Here the layout is found, not drawn: 2,048 one-hot blocks go through the
# real tiling, and each weight's byte tells which thread loads it.

# %%
one_hot = torch.zeros(64 * 32, 64, 32, dtype=torch.uint8)  # [position, row, K]: one nonzero code each
one_hot.view(64 * 32, -1)[torch.arange(64 * 32), torch.arange(64 * 32)] = 1
blocks = code_blocks(pack_e2m1(one_hot), 64)
byte = blocks.view(64 * 32, 1024).nonzero()[:, 1].view(64, 32)  # the byte holding weight (row, K)
thread = byte // 8
print("threads:", int(thread.max()) + 1, "| weights per thread:", int(torch.bincount(thread.flatten()).max()),
      "| rows of thread 0:", sorted(set((thread == 0).nonzero()[:, 0].tolist())),
      "| K of thread 0:", sorted(set((thread == 0).nonzero()[:, 1].tolist())))
fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), gridspec_kw={"width_ratios": [1, 2]})
axes[0].imshow((thread // 32).numpy(), cmap="Set2", aspect="auto", interpolation="nearest", vmin=0, vmax=7)
for w in range(4):
    axes[0].text(15.5, 16 * w + 7.5, f"warp {w}", ha="center", va="center", fontsize=10)
axes[0].set(xlabel="K within the group", ylabel="row of the 64-row tile", title="the warp that loads each weight")
lane = (thread % 32)[:16].numpy()
axes[1].imshow(lane, cmap="twilight", aspect="auto", interpolation="nearest", vmin=0, vmax=32)
for r in range(16):
    for q in range(8):
        axes[1].text(4 * q + 1.5, r, str(lane[r, 4 * q]), ha="center", va="center", fontsize=7)
axes[1].set(xlabel="K within the group", ylabel="row", title="warp 0: the lane that loads each weight (4 K per label)")
figs.save(fig, "tc_fragment_layout")

# %% [markdown]
# Thread 0 holds rows 0 and 8 at K 0..3 and 16..19: the first lane's share of an m64 x k32 wgmma A fragment.
# On the H200 this path is bit-identical to its recipe (the tensor cores' own k32 sums,
# `docs/decode-kernel-tc.md`), and faster than the CUDA-core decode at every token count.
