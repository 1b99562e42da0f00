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
# # 6. Kernel walkthrough: the plan, the waves, the bytes and FLOPs, the roofline
#
# Notebooks 1-5 followed the data. This one follows the *schedule*: how FlashInfer's persistent
# MXFP4 Mega MoE kernel picks its plan from the token count, how much work each wave of experts
# offers the 132 SMs of an H200, what each stage must move and compute, and where that puts the
# floor. Everything is computed from the library's own models (`megamoe.layouts.plans`,
# `megamoe.geometry`, `megamoe.bench.roofline`); real timings come from `bench/results/` when a GPU
# run has been committed there.
#
# Ladder: (6.1) the plan for a token count, (6.2) tiles per expert per wave, (6.3) bytes and FLOPs
# per stage, (6.4) the roofline and the floor, (6.5) measured timings.

# %%
import json

import torch
import matplotlib.pyplot as plt

from megamoe import get_geometry
from megamoe.bench.ceilings import Ceilings
from megamoe.bench.roofline import BYTES_PER_WEIGHT, step_floor
from megamoe.layouts.plans import (
    H20_NUM_SMS, H200_NUM_SMS, flashinfer_legal_block_ms, flashinfer_mxfp4_plan, padding_waste,
)
from megamoe.inputs import make_routing

from _nb import REPO, Figures

figs = Figures("06_kernel_walkthrough")
g = get_geometry("dsv4-flash")
T_MAX = 8192  # num_max_tokens_per_rank the symmetric buffer was sized for
token_counts = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]


def plan(t, num_ranks=1, num_sms=H200_NUM_SMS):
    return flashinfer_mxfp4_plan(num_sms, num_ranks, g.num_experts, g.num_topk, g.hidden, g.intermediate, T_MAX, t)


# %% [markdown]
# ## 6.1 The plan for a token count
#
# FlashInfer compiles one kernel per plan and chooses the plan from the token count T on the rank
# (`flashinfer_mxfp4_plan` restates its rule): BLOCK_M (pool rows per M tile), experts per wave,
# pipeline stages, and swap-AB (tokens on the MMA's N side, for few rows per expert). Below, the plan
# over T at DeepSeek-V4-Flash on one H200 (132 SMs), 8 H200 ranks, and one H20 (78 SMs).

# %%
print(f"legal BLOCK_M on one H200: {flashinfer_legal_block_ms(g)}")
print(f"{'T':>5} {'BM':>3} {'BN':>4} {'experts/wave':>12} {'stages':>6} {'swap_ab':>7} {'rs_swap':>7} {'BM @ R=8':>8} {'BM @ H20':>8}")
for t in token_counts:
    p = plan(t)
    print(f"{t:5d} {p.block_m:3d} {p.block_n:4d} {p.num_experts_per_wave:12d} {p.num_stages:6d} {str(p.swap_ab):>7} "
          f"{str(p.rs_swap_ab):>7} {plan(t, num_ranks=8).block_m:8d} {plan(t, num_sms=H20_NUM_SMS).block_m:8d}")

# %%
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 3.6))
dense_t = sorted({int(v) for v in torch.logspace(0, 13, 200, base=2).tolist()})
for label, kw in (("H200, R=1", {}), ("H200, R=8", {"num_ranks": 8}), ("H20, R=1", {"num_sms": H20_NUM_SMS})):
    ax0.step(dense_t, [plan(t, **kw).block_m for t in dense_t], where="post", label=label)
ax0.set(xscale="log", xlabel="tokens per rank T", ylabel="BLOCK_M", title="FlashInfer plan: BLOCK_M from T")
ax0.legend()
ax1.step(dense_t, [plan(t).num_experts_per_wave for t in dense_t], where="post", label="experts per wave")
ax1.step(dense_t, [plan(t).num_stages for t in dense_t], where="post", label="pipeline stages")
ax1.step(dense_t, [8 * plan(t).swap_ab for t in dense_t], where="post", ls=":", label="swap-AB (8 = on)")
ax1.set(xscale="log", xlabel="tokens per rank T", title="experts per wave, stages, swap-AB (H200, R=1)")
ax1.legend(fontsize=8)
figs.save(fig, "plan_vs_tokens")

# %% [markdown]
# ## 6.2 Tiles per expert per wave
#
# The persistent kernel walks the local experts in waves of `num_experts_per_wave`. Within a wave,
# the L1 work is one tile per (M block of an expert's rows, BLOCK_N = 256 columns of 2I); with
# E_l experts and n_e rows each, the wave offers `sum_e ceil(n_e / BLOCK_M) * 2I / 256` L1 tiles to
# 132 SMs. (Counted as BLOCK_M x BLOCK_N work units whether or not swap-AB puts the tokens on the
# MMA's N side; waves taken as consecutive local experts: a model of the order, not a measurement.)
# Few rows per expert -> few tiles per wave -> idle SMs; that is the small-T regime.

# %%
waves = {}
for t in (8, 512, 8192):
    p = plan(t)
    idx, _ = make_routing(t, g.num_experts, g.num_topk, gen=torch.Generator().manual_seed(t))
    n_e = torch.bincount(idx[idx >= 0], minlength=g.num_experts)  # [E] rows per expert
    m_blocks = (n_e + p.block_m - 1) // p.block_m  # [E]
    l1_tiles = m_blocks * (2 * g.intermediate // p.block_n)  # [E]
    per_wave = l1_tiles.view(-1, p.num_experts_per_wave).sum(1)  # [waves]
    waste = padding_waste(n_e, p.block_m)
    waves[t] = per_wave
    print(f"T={t:5d}: BLOCK_M {p.block_m}, {per_wave.numel()} waves of {p.num_experts_per_wave} experts; "
          f"L1 tiles per wave median {int(per_wave.median())} (SMs {H200_NUM_SMS}); "
          f"padding {waste.fraction:.0%} of {waste.padded_rows} pool rows")

# %%
fig, axes = plt.subplots(1, len(waves), figsize=(13, 3.4), sharey=False)
for ax, (t, per_wave) in zip(axes, waves.items()):
    ax.bar(range(per_wave.numel()), per_wave.numpy(), color="tab:blue")
    ax.axhline(H200_NUM_SMS, color="r", ls="--", lw=1, label="132 SMs")
    ax.set(xlabel="wave", ylabel="L1 tiles", title=f"T = {t}: BLOCK_M {plan(t).block_m}, {plan(t).num_experts_per_wave} experts/wave")
    ax.legend(fontsize=8, loc="lower right", framealpha=0.9)
figs.save(fig, "tiles_per_wave")

# %% [markdown]
# ## 6.3 Bytes and FLOPs per stage
#
# Napkin math from `Geometry.expert_weight_bytes` and `flops_per_routed_row`: MXFP4 costs 0.53125
# bytes per weight (4 bits + one E8M0 byte per 32). Weights are read once per *touched* expert,
# activations once per routed row. At small T the weights dominate (each touched expert's ~13 MB for
# a handful of rows); at large T every expert is touched and FLOPs grow with rows.

# %%
bpw = BYTES_PER_WEIGHT["mxfp4"]
h, i = g.hidden, g.intermediate


def stage_costs(t):
    idx, _ = make_routing(t, g.num_experts, g.num_topk, gen=torch.Generator().manual_seed(7 + t))
    rows = int((idx >= 0).sum())
    touched = int(torch.unique(idx[idx >= 0]).numel())
    return touched, rows, {
        "dispatch": (rows * (h + h // 128 * 4), 0.0),  # FP8 row + its scales copied into the pool
        "L1 gate|up": (touched * 2 * i * h * bpw, rows * 2.0 * 2 * i * h),
        "SwiGLU+requant": (0.0, 0.0),  # on-chip: no HBM bytes, negligible FLOPs
        "L2 down": (touched * h * i * bpw, rows * 2.0 * h * i),
        "combine": (rows * h * 2 + t * h * 2, rows * h),  # bf16 rows back, y written
    }


print(f"one expert: {g.expert_weight_bytes(bpw) / 1e6:.1f} MB of MXFP4 weights; {g.flops_per_routed_row() / 1e6:.1f} MFLOP per routed row")
costs = {}
for t in (8, 512, 8192):
    touched, rows, c = stage_costs(t)
    costs[t] = c
    tot_b, tot_f = sum(v[0] for v in c.values()), sum(v[1] for v in c.values())
    print(f"T={t:5d}: {touched:3d} experts touched, {rows:6d} rows; {tot_b / 1e6:8.1f} MB, {tot_f / 1e9:8.1f} GFLOP, "
          f"intensity {tot_f / tot_b:6.1f} FLOP/B; weights {100 * (c['L1 gate|up'][0] + c['L2 down'][0]) / tot_b:.0f}% of bytes")

# %%
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 3.6))
stages = list(costs[8])
width = 0.27
for j, (t, c) in enumerate(costs.items()):
    ax0.bar([s + (j - 1) * width for s in range(len(stages))], [c[s_][0] / 1e6 for s_ in stages], width, label=f"T={t}")
    ax1.bar([s + (j - 1) * width for s in range(len(stages))], [c[s_][1] / 1e9 for s_ in stages], width, label=f"T={t}")
for ax, ylabel in ((ax0, "MB moved (HBM / NVLink)"), (ax1, "GFLOP")):
    ax.set_xticks(range(len(stages)), stages, fontsize=8)
    ax.set(yscale="log", ylabel=ylabel)
    ax.legend(fontsize=8)
ax0.set_title("bytes per stage (DeepSeek-V4-Flash, R=1)")
ax1.set_title("FLOPs per stage")
figs.save(fig, "bytes_flops_per_stage")

# %% [markdown]
# ## 6.4 The roofline and the floor
#
# The floor of a step is `max(bytes / copy bandwidth, FLOPs / FP8 rate)` (`megamoe.bench.roofline.step_floor`).
# The ceilings are **quoted, not measured here**: `shared/design/KERNELS.md`, "Measured on one H200":
# device copy 4.24 TB/s (read + written), FP8 matmul 1422 TFLOP/s (`torch._scaled_mm`, 8192^3),
# bf16 815 TFLOP/s. The ridge point is 1422e12 / 4.24e12 = 335 FLOP per byte: below it a step is
# bandwidth-bound.

# %%
H200_QUOTED = Ceilings(device="H200 (quoted from shared/design/KERNELS.md, not measured here)",
                       copy_gbps=4240.0, fp8_tflops=1422.0, bf16_tflops=815.0)
floors = {}
for t in token_counts:
    idx, _ = make_routing(t, g.num_experts, g.num_topk, gen=torch.Generator().manual_seed(1000 + t))
    floors[t] = step_floor(g, idx, H200_QUOTED)
ridge = H200_QUOTED.fp8_tflops * 1e12 / (H200_QUOTED.copy_gbps * 1e9)
print(f"ridge point {ridge:.0f} FLOP/B")
print(f"{'T':>5} {'experts':>7} {'MB':>8} {'GFLOP':>8} {'FLOP/B':>7} {'floor us':>9} bound")
for t, f in floors.items():
    print(f"{t:5d} {f.experts_touched:7d} {f.bytes / 1e6:8.1f} {f.flops / 1e9:8.1f} {f.flops / f.bytes:7.1f} {f.floor_us:9.1f} {f.bound}")

# %% [markdown]
# ## 6.5 Measured timings
#
# Real kernel times come from `megamoe bench` runs committed under `bench/results/` (each a
# `results.json` with `rows` of backend, tokens, median_us). We draw any we find on the floor's plot.

# %%
result_files = sorted((REPO / "bench" / "results").rglob("*.json"))
measured = {}  # label -> (tokens, median_us)
for path in result_files:
    try:
        res = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        print(f"skipped {path.relative_to(REPO)}: {err}")
        continue
    if not isinstance(res, dict):
        print(f"skipped {path.relative_to(REPO)}: not a `megamoe bench` results file")
        continue
    rows = [r for r in res.get("rows", []) if r.get("pass", 0) == 0 and "median_us" in r and "tokens" in r]
    card = res.get("meta", {}).get("card", "?")
    for backend in sorted({r["backend"] for r in rows}):
        rr = sorted((r for r in rows if r["backend"] == backend), key=lambda r: r["tokens"])
        measured[f"{backend} ({card})"] = ([r["tokens"] for r in rr], [r["median_us"] for r in rr])
        print(f"{path.relative_to(REPO)}: {backend} on {card}: " + ", ".join(f"T={r['tokens']} {r['median_us']:.0f} us" for r in rr))
if not measured:
    print(f"No GPU timings in bench/results/ yet ({len(result_files)} JSON files found): "
          "the plot shows the modelled floor only. Run `megamoe bench` on an H200 and commit its results.json.")

# %%
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4))
ai = torch.logspace(-1, 4, 200)
roof = torch.minimum(ai * H200_QUOTED.copy_gbps * 1e9, torch.tensor(H200_QUOTED.fp8_tflops * 1e12)) / 1e12
ax0.plot(ai.numpy(), roof.numpy(), "k-", label="H200 roof (quoted ceilings)")
for t, f in floors.items():
    inten = f.flops / f.bytes
    ax0.scatter([inten], [f.flops / (f.floor_us * 1e-6) / 1e12], s=20)
    if t in (1, 8, 32, 128, 512, 2048, 8192):
            ax0.annotate(str(t), (inten, f.flops / (f.floor_us * 1e-6) / 1e12), fontsize=7, xytext=(3, -8), textcoords="offset points")
ax0.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP / byte)", ylabel="TFLOP/s at the floor",
        title="roofline: each point a token count T")
ax0.legend(fontsize=8)
ax1.plot(list(floors), [f.floor_us for f in floors.values()], "k--", marker="o", label="floor (this notebook's model)")
for label, (ts, us) in measured.items():
    ax1.plot(ts, us, marker=".", label=label)
ax1.legend(fontsize=7)
ax1.set(xscale="log", yscale="log", xlabel="tokens per rank T", ylabel="us per layer", title="the floor over T (and measured times, if any)")
figs.save(fig, "roofline")

# %% [markdown]
# **Takeaway.** Up to a few hundred tokens the layer is bound by reading the touched experts'
# weights (the floor grows with experts touched, then saturates at all 256); only near 8192 tokens
# does it become FP8-compute-bound. The plan follows: small BLOCK_M and swap-AB while experts get a
# few rows each, BLOCK_M 64 once every wave has enough tiles to fill the SMs.
