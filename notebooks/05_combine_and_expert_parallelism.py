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
# # 5. The down GEMM, the slot-ordered combine, and expert parallelism over R ranks
#
# After the down GEMM each pool row is one (token, slot) result, rounded to bf16 and written back to the token's
# source rank. The combine sums a token's K slots in FP32 *in ascending slot order*, skipping masked
# slots, and rounds once to bf16. With R expert-parallel ranks, every rank owns E / R experts and
# pulls its rows from every other rank; the result must not depend on R.
#
# Ladder: (5.1) the down GEMM's output per (token, slot), (5.2) why the slot order is fixed, (5.3) R simulated
# ranks give bit-identical outputs and the traffic between them, (5.4) ragged steps: one agreed token
# count, padded with masked rows.

# %%
import torch
import matplotlib.pyplot as plt

from megamoe import get_geometry, make_inputs, random_mxfp4_weights
from megamoe.inputs import MoEInputs
from megamoe.recipe import get_recipe
from megamoe.reference import combine, moe_forward, moe_forward_ep, undispatch
from megamoe.testing import first_mismatch

from _nb import Figures

figs = Figures("05_combine_and_expert_parallelism")
g = get_geometry("small")  # E = 16, K = 4, H = 512, I = 256
recipe = get_recipe("deepgemm-sm90-fp4")  # runs on raw scales (no global scales needed)
weights = random_mxfp4_weights(g, seed=11)
print(g)

# %% [markdown]
# ## 5.1 The down GEMM's output per (token, slot)
#
# `l2_out` is one bf16 row per pool row. Sent back to the source rank, it becomes `slots [T, K, H]`
# with a `filled [T, K]` mask (masked slots never ran). We take a step with masked slots and one token
# whose every slot is masked: its output row must be exactly zero.

# %%
T = 32
inp = make_inputs(g, T, seed=12, mask_prob=0.15, fully_masked_tokens=(5,))
res = moe_forward(inp, weights, recipe, g, keep_stages=True)
st = res.ranks[0]
slots, filled = undispatch([st.l2_out], [st.layout], 0, T, g.num_topk)  # [T, K, H] bf16, [T, K]
y = res.y[0]  # [T, H]
print(f"pool rows {st.layout.num_pool_rows}, routed slots {int(filled.sum())} of {T * g.num_topk} "
      f"({(~filled).float().mean():.0%} masked)")
print(f"token 5 (all slots masked): output row all zero = {bool((y[5] == 0).all())}")
print(f"recombined slots == pipeline output, bitwise: {first_mismatch(combine(slots, filled, recipe), y) == ''}")
slot_norm = slots.float().norm(dim=2)  # [T, K] contribution size of each slot

# %%
fig, ax = plt.subplots(figsize=(11, 3.6))
bottom = torch.zeros(T)
for k in range(g.num_topk):
    ax.bar(range(T), slot_norm[:, k].numpy(), bottom=bottom.numpy(), label=f"slot {k}")
    bottom += slot_norm[:, k]
ax.set(xlabel="token", ylabel="|slot output| (stacked)", title="L2 output per (token, slot); gaps = masked slots")
ax.legend(ncol=g.num_topk, fontsize=8)
figs.save(fig, "slot_outputs")

# %% [markdown]
# ## 5.2 Why the slot order is fixed
#
# FP32 addition is not associative, so the contract fixes the order: slots 0, 1, ..., K-1. How much
# does it matter? Each slot row is already rounded to bf16 (8 significant bits), and a sum of K such
# numbers fits FP32's 24 bits exactly unless their exponents are far apart, so for the kernel's
# bf16 slots the order should almost never show. A reference that skipped the per-slot bf16 rounding
# (FP32 slot rows) would see the order. We measure both, with a reversed and a shuffled order.

# %%
perm = torch.randperm(g.num_topk, generator=torch.Generator().manual_seed(0))
orders = {"reversed": torch.arange(g.num_topk - 1, -1, -1), f"shuffled {perm.tolist()}": perm}
fp32_recipe = recipe.with_(name="fp32 slots", slot_output_bf16=False, combine_bf16=False)
st32 = moe_forward(inp, weights, fp32_recipe, g, keep_stages=True).ranks[0]
slots32, filled32 = undispatch([st32.l2_out], [st32.layout], 0, T, g.num_topk)  # [T, K, H] fp32
y32 = combine(slots32, filled32, fp32_recipe)
changed = {}
for name, order in orders.items():
    y_o = combine(slots[:, order], filled[:, order], recipe)
    changed[f"bf16 slots, {name}"] = float((y_o.view(torch.int16) != y.view(torch.int16)).float().mean())
    y_o32 = combine(slots32[:, order], filled32[:, order], fp32_recipe)
    changed[f"fp32 slots, {name}"] = float((y_o32.view(torch.int32) != y32.view(torch.int32)).float().mean())
for name, v in changed.items():
    print(f"{name:32s}: {v:.2%} of outputs differ from the ascending-slot sum")

# %%
fig, ax = plt.subplots(figsize=(8, 3.6))
ax.barh(list(changed), [100 * v for v in changed.values()],
        color=["tab:blue" if k.startswith("bf16") else "tab:red" for k in changed])
for i, v in enumerate(changed.values()):
    ax.text(100 * v, i, f" {v:.2%}", va="center", fontsize=8)
ax.invert_yaxis()
ax.set(xlabel="% of output elements that change", title="combine order vs ascending slot order")
figs.save(fig, "combine_order")

# %% [markdown]
# ## 5.3 Expert parallelism over R simulated ranks
#
# `moe_forward_ep` runs R ranks in one process: rank r owns experts [r E/R, (r+1) E/R), builds its
# pool from every source rank's rows, and sends each result row home. Every row's arithmetic is
# independent of which other rows share its pool, so the output is bit-identical for every R. The
# all-to-all traffic is the matrix of rows source rank -> destination rank; each row costs H FP8 bytes
# plus H/128 FP32 scales going out and H bf16 bytes coming back. (Tiny preset, E = 8, so that R = 8
# leaves one expert per rank.)

# %%
g = get_geometry("tiny")
weights = random_mxfp4_weights(g, seed=13)
R_max = 8
TR = 12
per_rank = [make_inputs(g, TR, seed=20 + r) for r in range(R_max)]  # 8 source ranks x 12 tokens
everything = MoEInputs(torch.cat([p.x for p in per_rank]), torch.cat([p.topk_idx for p in per_rank]),
                       torch.cat([p.topk_weights for p in per_rank]))
y_one = moe_forward(everything, weights, recipe, g)  # one rank holding all 96 tokens
identical = {}
for R in (1, 2, 4, 8):
    # R ranks, each holding R_max / R of the source batches, so the same 96 tokens overall
    grouped = [MoEInputs(*(torch.cat([getattr(p, f) for p in per_rank[i::R]]) for f in ("x", "topk_idx", "topk_weights")))
               for i in range(R)]
    out = moe_forward_ep(grouped, weights, recipe, g, keep_stages=(R == R_max))
    # reassemble in the original token order: rank i holds batches i, i+R, ...
    rows = [o.view(len(per_rank[i::R]), TR, -1) for i, o in enumerate(out.y)]
    y_r = torch.cat([rows[b % R][b // R] for b in range(R_max)])
    identical[R] = first_mismatch(y_r, y_one) == ""
    print(f"R = {R}: y bitwise equal to one rank: {identical[R]}")
res8 = out  # R = 8: rank i holds source batch i
traffic = torch.stack([torch.bincount(st.layout.src_rank[st.layout.is_real], minlength=R_max)
                       for st in res8.ranks]).T  # [src, dst] rows
bytes_per_row_out = g.hidden + g.hidden // 128 * 4
bytes_per_row_back = g.hidden * 2
remote = int(traffic.sum() - traffic.diag().sum())
print(f"R = 8: {int(traffic.sum())} routed rows, {remote} cross-rank ({remote / traffic.sum():.0%}); "
      f"NVLink bytes per step {remote * (bytes_per_row_out + bytes_per_row_back) / 1e3:.0f} kB "
      f"({bytes_per_row_out} B out + {bytes_per_row_back} B back per row)")

# %%
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4))
im = ax0.imshow(traffic.numpy(), cmap="Blues")
for s_ in range(R_max):
    for d_ in range(R_max):
        ax0.text(d_, s_, int(traffic[s_, d_]), ha="center", va="center", fontsize=7)
ax0.set(xlabel=f"destination rank (owns {g.num_experts // R_max} expert)", ylabel=f"source rank ({TR} tokens)", title="dispatch traffic, rows (R = 8)")
ax0.grid(False)
ax1.bar(range(R_max), [st.layout.num_routed_rows for st in res8.ranks], color="tab:blue")
ax1.set(xlabel="destination rank", ylabel="rows in its pool", title="pool sizes: each rank's load")
figs.save(fig, "ep_traffic")

# %% [markdown]
# ## 5.4 Ragged steps: one agreed token count
#
# In data-parallel serving, ranks arrive with different token counts (some with none). FlashInfer
# picks its plan (BLOCK_M, experts per wave) from the token count, so every rank of a launch must
# pass the same count, or ranks run different tile shapes next to each other (1.5-1.9x slower on 8x
# H200, docs/kernel-contract.md). The rule (`megamoe.layouts.plans.agreed_token_count`): every rank passes the
# step's max and pads with rows routed to -1 (`megamoe.inputs.pad_inputs`). Masked
# rows are never dispatched, so real rows do not change; we check that bitwise.

# %%
from megamoe.inputs import pad_inputs  # noqa: E402
from megamoe.layouts.plans import agreed_token_count  # noqa: E402

counts = [19, 0, 32, 5]
ragged = [make_inputs(g, t, seed=40 + r) for r, t in enumerate(counts)]
agreed = agreed_token_count(counts)
padded = [pad_inputs(p, agreed) for p in ragged]
y_ragged = moe_forward_ep(ragged, weights, recipe, g).y
y_padded = moe_forward_ep(padded, weights, recipe, g).y
same = all(first_mismatch(yp[:t], yr) == "" for yp, yr, t in zip(y_padded, y_ragged, counts))
pad_zero = all(bool((yp[t:] == 0).all()) for yp, t in zip(y_padded, counts))
print(f"token counts per rank {counts} -> agreed count {agreed}; "
      f"padding rows {sum(agreed - t for t in counts)} ({sum(agreed - t for t in counts) / (agreed * len(counts)):.0%} of the launch)")
print(f"real rows bitwise unchanged by the padding: {same}; padding rows' output zero: {pad_zero}")

# %%
fig, ax = plt.subplots(figsize=(7, 3.4))
ax.bar(range(len(counts)), counts, label="real tokens")
ax.bar(range(len(counts)), [agreed - t for t in counts], bottom=counts, color="0.8", label="padding (routed to -1)")
ax.axhline(agreed, color="k", ls="--", lw=1, label=f"agreed count {agreed}")
ax.set(xlabel="rank", ylabel="tokens passed to the kernel", title="a ragged step, padded to one token count")
ax.set_xticks(range(len(counts)))
ax.legend(fontsize=8)
figs.save(fig, "ragged_agreement")

# %% [markdown]
# **Takeaway.** The combine is a fixed-order FP32 sum of bf16 rows (in practice exact), so EP over
# any R is bit-reproducible; the
# price of agreeing on one plan is a few masked rows on short ranks, which cost no FLOPs (masked
# rows are never dispatched) but do set the plan for everyone.
