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
# `megamoe.geometry`, `megamoe.bench.roofline`); the ceilings and timings are the H200 sweep the README
# cites (`bench/results/CITED.json` names it). Then it opens one CTA: which warps do what, how shared
# memory holds the TMA -> WGMMA pipeline, how a routed row travels between ranks, and how the persistent
# kernel hands tasks to the SMs, all drawn from the plans the kernels printed on the H200
# (`megamoe.teaching.anatomy`, `megamoe.teaching.plans_viz`). Last, the three SM90 kernels side by side: how each
# decodes, requantizes and plans, and whether it repeats itself.
#
# Ladder: (6.1) the plan for a token count, (6.2) tiles per expert per wave, (6.3) bytes and FLOPs
# per stage, (6.4) the roofline and the floor, (6.5) measured timings, (6.6) warps and their roles,
# (6.7) shared memory and the TMA -> WGMMA pipeline, (6.8) dispatch and combine over symmetric memory,
# (6.9) the persistent schedule, (6.10) the three kernels side by side.

# %%
import json

import torch
import matplotlib.pyplot as plt

from megamoe import get_geometry
from megamoe.bench.ceilings import Ceilings
from megamoe.bench.roofline import BYTES_PER_WEIGHT, step_floor
from megamoe.bench.tables import load_results
from megamoe.layouts.plans import (
    H20_NUM_SMS, H200_NUM_SMS, flashinfer_legal_block_ms, flashinfer_mxfp4_plan, padding_waste,
)
from megamoe.inputs import make_routing

from _nb import REPO, Figures, cited
from _kernel_walkthrough import (
    draw_plan_vs_tokens, draw_recorded_plans, draw_relaunches, draw_roofline, draw_stage_costs, draw_tiles_per_wave,
    side_by_side_table,
)

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
draw_plan_vs_tokens(ax0, ax1, plan)
figs.save(fig, "plan_vs_tokens")

# %% [markdown]
# ## 6.2 Tiles per expert per wave
#
# The persistent kernel walks the local experts in waves of `num_experts_per_wave`. Within a wave,
# the gate/up work is one tile per (M block of an expert's rows, BLOCK_N = 256 columns of 2I); with
# E_l experts and n_e rows each, the wave offers `sum_e ceil(n_e / BLOCK_M) * 2I / 256` gate/up tiles to
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
draw_tiles_per_wave(axes, waves, plan)
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
draw_stage_costs(ax0, ax1, costs)
figs.save(fig, "bytes_flops_per_stage")

# %% [markdown]
# ## 6.4 The roofline and the floor
#
# The floor of a step is `max(bytes / copy bandwidth, FLOPs / FP8 rate)` (`megamoe.bench.roofline.step_floor`).
# The ceilings are the ones the cited sweep **measured on its own card, in the same run**: a 2 GiB
# device-to-device copy (bytes read + written) and `torch._scaled_mm` in e4m3 at 8192^3. The ridge
# point is FP8 rate / copy bandwidth: below it a step is bandwidth-bound.

# %%
SWEEP = cited("sweep")
sweep = load_results(SWEEP)  # results.json, or .json.gz as committed
c = sweep["ceilings"]
H200 = Ceilings(device=f"{c['device']} (measured in {SWEEP.name})", copy_gbps=c["copy_gbps"],
                fp8_tflops=c["fp8_tflops"], bf16_tflops=c["bf16_tflops"])
print(f"ceilings from {SWEEP.relative_to(REPO)}: copy {H200.copy_gbps:.0f} GB/s, FP8 {H200.fp8_tflops:.0f} TFLOP/s, "
      f"bf16 {H200.bf16_tflops:.0f} TFLOP/s")
floors = {}
for t in token_counts:
    idx, _ = make_routing(t, g.num_experts, g.num_topk, gen=torch.Generator().manual_seed(1000 + t))
    floors[t] = step_floor(g, idx, H200)
ridge = H200.fp8_tflops * 1e12 / (H200.copy_gbps * 1e9)
print(f"ridge point {ridge:.0f} FLOP/B")
print(f"{'T':>5} {'experts':>7} {'MB':>8} {'GFLOP':>8} {'FLOP/B':>7} {'floor us':>9} bound")
for t, f in floors.items():
    print(f"{t:5d} {f.experts_touched:7d} {f.bytes / 1e6:8.1f} {f.flops / 1e9:8.1f} {f.flops / f.bytes:7.1f} {f.floor_us:9.1f} {f.bound}")

# %% [markdown]
# ## 6.5 Measured timings
#
# The kernel times of the same sweep (`megamoe bench` on one H200: median of at least 1 s of calls,
# each backend checked against its reference first; its `NOTE.md` says how it was run). Only the
# cited run is drawn: `bench/results/` holds older runs too, kept as evidence, not as figures.

# %%
rows = [r for r in sweep["rows"] if r.get("pass", 0) == 0 and "median_us" in r]
measured = {}  # backend -> (tokens, median_us)
for backend in sorted({r["backend"] for r in rows}):
    rr = sorted((r for r in rows if r["backend"] == backend), key=lambda r: r["tokens"])
    measured[backend] = ([r["tokens"] for r in rr], [r["median_us"] for r in rr])
    print(f"{backend:22s} " + ", ".join(f"T={r['tokens']} {r['median_us']:.0f} us" for r in rr[::3]))
print(f"card {sweep['meta']['card']}, commit {sweep['meta']['commit']}, versions {sweep['meta']['versions']}")

# %%
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4))
draw_roofline(ax0, ax1, floors, measured, H200, SWEEP.name)
figs.save(fig, "roofline")

# %% [markdown]
# ## 6.6 Inside one CTA: which warps do what
#
# Each kernel launches one CTA per SM for the whole layer (persistent) and splits its warps into
# roles that run side by side, each held at its own register budget (`setmaxnreg`, per warpgroup):
#
# - **dispatch** warps count the routes, then pull the routed token rows (and their scales and routing
#   weight) from the source ranks' symmetric buffers into this rank's pool; later they clean up.
# - **TMA A** loads the activation tiles and their scales of a task once its pool block's rows have
#   arrived; **TMA B** loads the weight tiles. They run up to `num_stages` K blocks ahead.
# - **decode** warps (FP4 kernels, where the plan gives them their own warps) turn the packed FP4
#   tile into e4m3 in shared memory, the per-32 scale folded in; elsewhere the math warps decode.
# - **math** warpgroups issue the WGMMAs, then run the epilogue: SwiGLU, the FP8 requant written to
#   the pool for the down GEMM, and after it the bf16 rows written straight into the source rank's combine
#   buffer; at the end they sum each token's top-k slots.
#
# Every row is a plan recorded on the H200: FlashInfer and DeepGEMM FP8 from the cited sweep, DeepGEMM
# SM90 FP4 (pull request #323, a source build) from its own H200 run (`bench/results/CITED.json` names
# both), each launch's configuration as the kernel's heuristic printed it plus the decode options of its
# JIT source. One FP4 field is not in the record: whether the two TMA warps also decode
# (`first_decode_assist_warp`); it comes from the restated heuristic
# (`megamoe.layouts.deepgemm_configs`), which reproduces every field the H200 printed
# (tests/test_deepgemm_fp4_recorded_configs.py).

# %%
from megamoe.teaching.anatomy import deepgemm_fp4_anatomy, deepgemm_fp8_anatomy, flashinfer_anatomy, recorded_plans  # noqa: E402
from megamoe.fused.fp4_records import JIT_SOURCE_FLAGS, recorded_fp4_configs  # noqa: E402
from megamoe.layouts.deepgemm_configs import buffer_tokens_per_rank, deepgemm_sm90_fp4_config  # noqa: E402
from megamoe.teaching.plans_viz import (  # noqa: E402
    draw_dispatch_combine, draw_pipeline, draw_schedule, draw_smem, draw_warps, interleaved_schedule,
    static_schedule,
)

recorded = recorded_plans({"rows": rows})
FP4 = cited("deepgemm_fp4")  # DeepGEMM SM90 FP4 on the H200: every sweep count at capacity 8192
fp4_plans = {r.tokens: r.fields for r in recorded_fp4_configs(FP4) if r.source == "probe-plans-lossy.json: plans"}
print(f"DeepGEMM SM90 FP4 plans recorded on the H200 ({FP4.relative_to(REPO)}): T = {sorted(fp4_plans)}")


def fi(t):
    return flashinfer_anatomy(recorded["flashinfer-mxfp4", t]["detail"], g)


def dg8(t):
    plan = recorded["deepgemm-sm90-fp8", t]
    return deepgemm_fp8_anatomy({**plan["detail"], "block_m": plan["block_m"]}, g)


def dg4(t):
    """The recorded FP4 plan; first_decode_assist_warp, where the record lacks it, from the restated heuristic."""
    rec, restated = fp4_plans[t], deepgemm_sm90_fp4_config(g, t, num_max_tokens_per_rank=buffer_tokens_per_rank(T_MAX))
    assert all(restated[k] == v for k, v in rec.items() if k not in JIT_SOURCE_FLAGS), t
    return deepgemm_fp4_anatomy({"first_decode_assist_warp": restated["first_decode_assist_warp"], **rec}, g)


kernels = {"FlashInfer T=1": fi(1), "FlashInfer T=512": fi(512), "FlashInfer T=8192": fi(8192),
           "DeepGEMM FP8 T=1": dg8(1), "DeepGEMM FP8 T=8192": dg8(8192),
           "DeepGEMM FP4 T=1": dg4(1), "DeepGEMM FP4 T=8192": dg4(8192)}
for label, a in kernels.items():
    print(f"{label:28s} BLOCK_M {a.block_m:3d} x BLOCK_N {a.block_n}, {a.num_stages} stages, swap-AB {str(a.swap_ab):5s} "
          f"{a.threads} threads: " + ", ".join(f"{r.name} {r.warps}" for r in a.roles))

fig, ax = plt.subplots(figsize=(12, 4.2))
draw_warps(ax, list(kernels.values()), list(kernels))
ax.set_title("warps of one CTA by role (w: warps, r: registers per thread); lines mark warpgroups")
figs.save(fig, "warp_roles")

# %% [markdown]
# ## 6.7 Shared memory and the TMA -> WGMMA pipeline
#
# Shared memory holds a few fixed regions (expert counters, the dispatch landing rows, the epilogue's
# staging tile, FlashInfer's decoded-weight tile) and a ring of `num_stages` stages, each one K block
# (128) of the A tile, the B tile and their scales. The loaders fill stage `k % S` while the math
# warps consume an older one; a stage is reused once its WGMMAs are done. Small-T plans keep tiles
# small and stages many (DeepGEMM FP8: 8), large-T plans trade stages for tile size. FlashInfer reuses
# the whole region as a ring of bf16 rows for the combine (dashed: 3 rows per math warp), which is
# why it asks for all 227 KB whatever the plan.

# %%
fig, ax = plt.subplots(figsize=(12, 4.2))
draw_smem(ax, list(kernels.values()), list(kernels))
ax.set_title("shared memory per CTA: fixed regions (grey), stages s0..s(S-1), combine ring (dashed)")
figs.save(fig, "smem_stages")

# %% [markdown]
# The mainloop below is a model with unit steps, not a trace: a load arrives 4 steps after it is
# issued (an assumed latency), a decode takes one step, one step of WGMMA consumes a K block. With S
# stages at most S loads are in flight, so a 3-stage plan with a decode step leaves the WGMMA waiting
# where an 8-stage plan does not; DeepGEMM FP4's recorded 5 stages at T = 1, with its decode warps
# between the loads and the WGMMA, still leave it waiting once per turn of the ring. The gate/up mainloop of DeepSeek-V4-Flash has H / 128 = 32 K blocks; 12
# are drawn.

# %%
fig, axes = plt.subplots(1, 4, figsize=(16, 3.2))
for ax, label in zip(axes, ("FlashInfer T=1", "FlashInfer T=512", "DeepGEMM FP8 T=1", "DeepGEMM FP4 T=1")):
    draw_pipeline(ax, kernels[label], 12, f"{label}: {kernels[label].num_stages} stages")
figs.save(fig, "tma_wgmma_pipeline")

# %% [markdown]
# ## 6.8 Dispatch and combine over symmetric memory
#
# Every rank allocates the same symmetric buffer, so a rank addresses another rank's copy directly
# over NVLink. Dispatch is a *pull*: rank 0's dispatch warps copy each row routed to its experts out
# of the source rank's staged input into its own pool. After the down GEMM, the epilogue *pushes* each (token,
# slot) output row back into the source rank's combine buffer, slot k; the source rank then sums its
# slots. No all-to-all collective runs: the GEMMs of early tasks overlap the pulls of later rows, and
# the write-back overlaps the remaining tasks. The byte counts below are DeepSeek-V4-Flash's.

# %%
fig, ax = plt.subplots(figsize=(12, 3.4))
draw_dispatch_combine(ax, g, num_ranks=4)
ax.set_title("one routed row: pulled by the expert's rank, its output written back into the source rank's slot")
figs.save(fig, "dispatch_combine")

# %% [markdown]
# ## 6.9 The persistent schedule
#
# The tasks are (pool block of BLOCK_M rows, N block) tiles of gate/up (N = 2I) and of down (N = H); a down
# task may start only when gate/up has written every column of its rows. DeepGEMM walks the experts in
# waves of `num_experts_per_wave`: all gate/up tasks of a wave, then its down tasks, SM i taking every 132nd
# task. FlashInfer (`use_interleaved_scheduler` in every H200 plan) lets the SMs claim tasks from two
# counters: a few gate/up claims to warm up, then down and gate/up alternately, a down claim waiting until its
# block's gate/up tasks are claimed. Each task one step here (a model of the order, not of durations);
# routing is random at T = 512 and 8192.

# %%
fig, axes = plt.subplots(2, 2, figsize=(12, 6))
for row, t in enumerate((512, 8192)):
    idx, _ = make_routing(t, g.num_experts, g.num_topk, gen=torch.Generator().manual_seed(2000 + t))
    counts = torch.bincount(idx[idx >= 0], minlength=g.num_experts).tolist()
    draw_schedule(axes[row, 0], interleaved_schedule(counts, fi(t), g, H200_NUM_SMS),
                  f"FlashInfer T={t}, {fi(t).block_m}x{fi(t).block_n} tiles")
    draw_schedule(axes[row, 1], static_schedule(counts, dg8(t), g, H200_NUM_SMS),
                  f"DeepGEMM FP8 T={t}, {dg8(t).block_m}x{dg8(t).block_n} tiles, waves of {dg8(t).num_experts_per_wave}")
fig.suptitle("tasks per SM over steps: L1 (olive), L2 (purple), waiting (white)", fontsize=9)
figs.save(fig, "persistent_schedule")

# %% [markdown]
# ## 6.10 The three SM90 kernels side by side
#
# What each kernel does to the numbers and how it plans, each fact marked with where it comes from:
# **measured** on the H200, **recorded** (the plans the kernel printed on the H200), or **recipe** (the
# rounding points `megamoe.recipe` models; docs/kernel-numerics.md says how each was measured). The
# DeepGEMM SM90 FP4 column is read from its H200 results folder: the decode table of all 256 scale
# bytes x 16 codes read back through a crafted layer (notebook 3 plots it), the reference variants that
# pin its down requant, the plan of every sweep token count, and a race probe that relaunched every count
# 20-60 times and compared the outputs bit for bit: first on the pull request as it is, then on the
# build with megamoe's proxy-fence patch (docs/deepgemm-fp4.md). FlashInfer and DeepGEMM FP8 were only
# relaunched by their matrices (8 times per case, no difference).

# %%
from megamoe.recipe import DEEPGEMM_SM90_FP4  # noqa: E402


def fp4_probe(name):
    return json.loads((FP4 / name).read_text())


lut = fp4_probe("probe-lut-checkpoint.json")["lut"]
variants = [v for v in fp4_probe("probe-determinism-variants.json")["variants"] if "code_match" in v["base-tc"]]
race = fp4_probe("probe-race.json")["race"]  # the pull request as it is
fenced = json.loads((cited("deepgemm_fp4_fences") / "race-2.json").read_text())["patched"]["fp4_probe.json"]["race"]
plans_of = {
    "flashinfer-mxfp4": {t: {"block_m": p["block_m"], **p["detail"]} for (b, t), p in recorded.items() if b == "flashinfer-mxfp4"},
    "deepgemm-sm90-fp4": fp4_plans,
    "deepgemm-sm90-fp8": {t: {**p["detail"], "block_m": p["block_m"]} for (b, t), p in recorded.items() if b == "deepgemm-sm90-fp8"},
}
names = ("FlashInfer MXFP4", "DeepGEMM SM90 FP4", "DeepGEMM SM90 FP8")  # the columns, in plans_of's order
lo, hi = lut["window_measured"]
assert (DEEPGEMM_SM90_FP4.min_scale_byte, DEEPGEMM_SM90_FP4.max_scale_byte) == (lo, hi)  # the recipe uses the measured window
table = side_by_side_table(lut, variants, race, fenced, plans_of)
for row, cells in table.items():
    print(row)
    for name, cell in zip(names, cells):
        print(f"  {name:18s} {cell}")

# %% [markdown]
# The same plans drawn over T, and the FP4 kernel's relaunches as the pull request builds it: at T = 96
# (2.25 rows per expert, the one count with early-B decode) 59 of 60 launches differ from the first;
# every racy count runs BLOCK_M 64 with swap-AB and 5 stages. The cause was missing proxy fences (scale
# factors written with plain stores, read by TMA on another SM); with megamoe's patch no launch at those
# counts differs (the black crosses). A rarer race remains where slots are masked: at T = 128, 0.1-2% of
# relaunches change the rows of one expert's tokens by a few bf16 ulps (docs/deepgemm-fp4.md). `megamoe
# check` reports any case that differs on a relaunch `nondeterministic`, a failure.

# %%
fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(15, 3.6))
draw_recorded_plans(ax0, ax1, plans_of, names)
draw_relaunches(ax2, race, fenced)
figs.save(fig, "kernels_side_by_side")

# %% [markdown]
# **Takeaway.** Up to a few hundred tokens the layer is bound by reading the touched experts'
# weights (the floor grows with experts touched, then saturates at all 256); only near 8192 tokens
# does it become FP8-compute-bound. The plan follows: small BLOCK_M and swap-AB while experts get a
# few rows each, BLOCK_M 64 once every wave has enough tiles to fill the SMs.
