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
# # 2. FP8 staging: one scale per token per 128 channels, and the error it costs
#
# Before the kernel runs, `x` (bf16 [T, H]) is cast to FP8 e4m3 with an FP32 scale per token per 128
# channels (`megamoe.layouts.staging.per_token_cast_to_fp8`, bit-exact with DeepGEMM's function as it
# runs on CUDA). The gate/up GEMM then multiplies each 128-wide K block's partial product by that scale
# (notebook 4). This is the first place the kernel loses precision.
#
# Ladder: (2.1) the scales, (2.2) the error per element, (2.3) why 128 channels per scale,
# (2.4) why the scale is a multiply by fl32(1/448) and not a division.

# %%
import torch
import matplotlib.pyplot as plt

from megamoe import get_geometry, make_inputs
from megamoe.formats import E4M3_MAX, e8m0_to_float, unpack_ue8m0_x4
from megamoe.layouts.staging import (
    dequantize_per_token_fp8, per_token_cast_to_fp8, per_token_cast_to_fp8_ue8m0_packed,
)
from megamoe.testing import rel_l2

from _nb import Figures

figs = Figures("02_fp8_staging")
g = get_geometry("dsv4-flash")  # staging is cheap: use the real hidden size, H = 4096
T = 256
inp = make_inputs(g, T, seed=2, outlier_channels=16)  # x100 on 16 channels, as real activations have
x = inp.x  # [T, H] bf16
print(f"x {tuple(x.shape)} {x.dtype}; |x| max {x.abs().max():.1f}, median {x.abs().float().median():.3f}")

# %% [markdown]
# ## 2.1 The scales
#
# `sf[t, j] = amax(|x[t, 128j : 128j + 128]|) * fl32(1/448)`: the largest value of each group lands
# on e4m3's largest finite value, 448. Groups holding an outlier channel get a ~100x larger scale, but
# only those groups: the other 31 groups of the token keep their resolution.

# %%
q, sf = per_token_cast_to_fp8(x)  # [T, H] e4m3, [T, H/128] fp32
print(f"q {tuple(q.shape)} {q.dtype}, sf {tuple(sf.shape)} {sf.dtype}")
print(f"scales span 2^{torch.log2(sf).min():.1f} .. 2^{torch.log2(sf).max():.1f}; "
      f"max |q| = {q.float().abs().max():.0f} (e4m3 max {E4M3_MAX:.0f})")

# %%
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 3.8), gridspec_kw={"width_ratios": [3, 1]})
im = ax0.imshow(torch.log2(sf).numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
fig.colorbar(im, ax=ax0, label="log2 sf")
ax0.set(xlabel="128-channel group j", ylabel="token t", title="x_sf[t, j]: one FP32 scale per token per 128 channels")
ax0.grid(False)
ax1.hist(torch.log2(sf).flatten().numpy(), bins=50, color="tab:purple")
ax1.set(xlabel="log2 sf", ylabel="groups", title="scale histogram: outlier groups on the right")
figs.save(fig, "scales")

# %% [markdown]
# ## 2.2 The error per element
#
# e4m3 has 3 mantissa bits: a value in the normal range (`|x / sf| >= 2^-6`) is off by at most
# 2^-4 = 6.25% of itself. Values far below their group's amax fall into e4m3's subnormals, where the
# step is fixed (2^-9 * sf) and the relative error grows: the price of sharing a scale with a large
# neighbour.

# %%
xd = dequantize_per_token_fp8(q, sf)  # [T, H] fp32: the values the MMA sees
xf = x.float()
nz = xf != 0
rel = ((xd - xf).abs() / xf.abs())[nz]
ratio = (xf.abs() / sf.repeat_interleave(128, dim=1))[nz]  # |x| / sf, i.e. the e4m3 magnitude before rounding
normal = ratio >= 2**-6
print(f"staging error: rel_l2(dequant(q), x) = {rel_l2(xd, xf):.4f}")
print(f"normal range: max relative error {rel[normal].max():.4f} (bound 2^-4 = {2**-4:.4f}); "
      f"subnormal elements {(~normal).float().mean():.2%}, their median relative error {rel[~normal].median():.3f}")

# %%
fig, ax = plt.subplots(figsize=(7, 4))
sel = torch.randperm(rel.numel(), generator=torch.Generator().manual_seed(0))[:40000]
ax.scatter(ratio[sel].numpy(), rel[sel].numpy(), s=1, alpha=0.3)
ax.axhline(2**-4, color="r", ls="--", lw=1, label="2^-4 bound (3 mantissa bits, RNE)")
ax.axvline(2**-6, color="k", ls=":", lw=1, label="e4m3 min normal 2^-6")
ax.set(xscale="log", yscale="log", ylim=(1e-5, 2), xlabel="|x| / sf (magnitude in e4m3 units)",
       ylabel="|dequant - x| / |x|", title="FP8 staging error per element")
ax.legend(loc="lower left")
figs.save(fig, "error_per_element")

# %% [markdown]
# ## 2.3 Why 128 channels per scale: dynamic range, not resolution
#
# e4m3 is a float: its relative step is the same from 2^-6 to 448, so an outlier that shares a scale
# with ordinary channels costs them nothing *until it pushes them below 2^-6*, into the subnormals,
# and then to zero (e4m3 spans 448 / 2^-6 = 2^15 in normals). Per-128 scales confine the damage
# to the outlier's own group of 128 channels. We sweep the outlier
# magnitude (16 channels multiplied by a factor) and measure the error of the *ordinary* channels.

# %%
base = make_inputs(g, T, seed=3).x.float()  # [T, H]
outlier_ch = torch.randperm(g.hidden, generator=torch.Generator().manual_seed(4))[:16]
ordinary = torch.ones(g.hidden, dtype=torch.bool)
ordinary[outlier_ch] = False
factors = [1, 10, 100, 1e3, 1e4, 1e5]
grans = [32, 128, 512, g.hidden]
err = {gran: [] for gran in grans}
for f in factors:
    xx = base.clone()
    xx[:, outlier_ch] *= f
    xx = xx.to(torch.bfloat16)
    for gran in grans:
        qq, ss = per_token_cast_to_fp8(xx, gran=gran)
        err[gran].append(rel_l2(dequantize_per_token_fp8(qq, ss)[:, ordinary], xx.float()[:, ordinary]))
q100, packed = per_token_cast_to_fp8_ue8m0_packed(x, gran=32)  # SM100 staging, for comparison
sf100 = e8m0_to_float(unpack_ue8m0_x4(packed))  # [T, H/32]
err_sm100 = rel_l2(dequantize_per_token_fp8(q100, sf100)[:, ordinary_x := x.float().abs().mean(0) < 10],
                   x.float()[:, ordinary_x])
err_sm90 = rel_l2(xd[:, ordinary_x], xf[:, ordinary_x])
print("rel_l2 of the ordinary channels vs outlier factor:")
print("factor   " + "".join(f"{'gran ' + str(gr):>11}" for gr in grans))
for j, f in enumerate(factors):
    print(f"{f:8.0e} " + "".join(f"{err[gr][j]:11.4f}" for gr in grans))
print(f"x100 outliers: SM90 fp32 per 128 {err_sm90:.4f}, SM100 UE8M0 per 32 {err_sm100:.4f} "
      "(power-of-two scales leave up to 2x of the e4m3 range unused)")

# %%
fig, ax = plt.subplots(figsize=(7, 4))
for gr in grans:
    ax.plot(factors, err[gr], marker="o", label=f"one scale per {gr} channels" + (" (per token)" if gr == g.hidden else ""))
ax.set(xscale="log", yscale="log", xlabel="outlier magnitude (x the typical channel)",
       ylabel="rel_l2 of the ordinary channels", title="FP8 staging: what an outlier costs its neighbours")
ax.legend()
figs.save(fig, "error_vs_granularity")

# %% [markdown]
# ## 2.4 Why a multiply by fl32(1/448), not a division
#
# DeepGEMM's source reads `amax / 448.0`, but PyTorch's CUDA kernel divides a tensor by a scalar via
# its reciprocal, so on the GPU the scale is `amax * fl32(1/448)`. docs/kernel-contract.md records the H200
# measurement; here we count how often a true division (what the same source gives on a CPU tensor)
# would differ, in the scale and then in the FP8 codes.

# %%
amax = x.float().view(T, -1, 128).abs().amax(2).clamp(min=1e-4)  # what both forms start from
sf_div = amax / E4M3_MAX  # true IEEE division
q_div = (x.float().view(T, -1, 128) * (1.0 / sf_div).unsqueeze(2)).clamp(-448, 448).to(torch.float8_e4m3fn).view(T, -1)
scale_diff = (sf_div != sf).float().mean().item()
code_diff = (q_div.view(torch.uint8) != q.view(torch.uint8)).float().mean().item()
print(f"scales that differ between multiply and divide: {scale_diff:.1%} (in the last bit)")
print(f"FP8 codes that differ as a result: {code_diff:.3%} of {q.numel()} elements")

# %%
fig, ax = plt.subplots(figsize=(6, 3.2))
ax.bar(["scales differ", "FP8 codes differ"], [100 * scale_diff, 100 * code_diff], color=["tab:orange", "tab:red"])
for i, v in enumerate((scale_diff, code_diff)):
    ax.text(i, 100 * v, f"{v:.2%}", ha="center", va="bottom")
ax.set(ylabel="% of elements", title="amax / 448 vs amax * fl32(1/448)")
figs.save(fig, "multiply_vs_divide")

# %% [markdown]
# **Takeaway.** Staging costs a few % relative L2 on ordinary channels, set by e4m3's 3 mantissa bits;
# per-128 scales keep large outliers from flushing their neighbours to zero. A bit-exact reference must spell out the multiply.
