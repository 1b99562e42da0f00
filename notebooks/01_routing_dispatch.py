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
# # 1. Routing and dispatch: which rows each expert gets, and what BLOCK_M costs
#
# The Mega MoE kernel never sees router logits: it receives `topk_idx [T, K]` and `topk_weights [T, K]`
# and turns them into a pool of rows sorted by expert, each expert's segment padded to a multiple of
# BLOCK_M. This notebook builds both with the library's reference (`megamoe.reference.route`,
# `build_layout`) and measures what they cost.
#
# Ladder: (1.1) DeepSeek-V4 scores and the per-expert histogram, (1.2) the selection-only bias,
# (1.3) the pool, (1.4) the padding waste per BLOCK_M over token counts.
#
# Routing and dispatch are index arithmetic only, so this notebook uses the real DeepSeek-V4-Flash
# geometry (E = 256, K = 6); no expert weights are needed.

# %%
import torch
import matplotlib.pyplot as plt

from megamoe import get_geometry
from megamoe.inputs import make_routing
from megamoe.reference import build_layout, expert_histogram, route

from _nb import Figures

figs = Figures("01_routing_dispatch")
g = get_geometry("dsv4-flash")
print(g)

# %% [markdown]
# ## 1.1 Scores and the per-expert histogram
#
# DeepSeek-V4 scores are `sqrt(softplus(logits))`; the top-K experts by score are selected, their
# scores normalised to sum 1 and multiplied by `routed_scaling` (1.5) once, here. Real routers are
# uneven: we give each expert a fixed popularity offset so a few experts run hot.

# %%
T = 2048
gen = torch.Generator().manual_seed(0)
popularity = torch.randn(g.num_experts, generator=gen) * 0.3  # [E] per-expert offset: hot and cold experts
logits = torch.randn(T, g.num_experts, generator=gen) + popularity  # [T, E]
topk_idx, topk_weights = route(logits, g)  # [T, K] int64, [T, K] fp32
hist = expert_histogram(topk_idx, g.num_experts)  # [E]

mean_load = T * g.num_topk / g.num_experts
print(f"tokens {T}, slots {T * g.num_topk}, mean rows per expert {mean_load:.1f}")
print(f"hottest expert {int(hist.max())} rows ({hist.max() / mean_load:.2f}x the mean), "
      f"coldest {int(hist.min())}; max/mean load = {hist.max() / mean_load:.2f}")
print(f"sum of a token's weights = {topk_weights.sum(1).mean():.4f} (routed_scaling {g.routed_scaling})")

# %%
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 3.6), gridspec_kw={"width_ratios": [3, 1]})
ax0.bar(range(g.num_experts), hist.numpy(), width=1.0, color="tab:blue")
ax0.axhline(mean_load, color="k", ls="--", lw=1, label=f"mean {mean_load:.0f}")
ax0.set(xlabel="expert", ylabel="rows routed", title=f"DeepSeek-V4 sqrtsoftplus routing, T={T}, K={g.num_topk}")
ax0.legend()
ax1.hist(topk_weights.flatten().numpy(), bins=60, color="tab:green")
ax1.set(xlabel="routing weight (after norm x 1.5)", ylabel="slots", title="topk_weights")
figs.save(fig, "expert_histogram")

# %% [markdown]
# ## 1.2 The noaux_tc bias steers selection only
#
# DeepSeek balances load without an auxiliary loss: a per-expert bias is added to the scores *for
# selection*, while the weights still come from the unbiased scores. Here we run the paper's update
# rule (`bias += gamma * sign(mean - load)`) for 40 steps on this batch and measure the imbalance.

# %%
bias = torch.zeros(g.num_experts)
imbalance = [float(hist.max() / mean_load)]
for _ in range(40):
    idx_b, _ = route(logits, g, bias=bias)
    load = expert_histogram(idx_b, g.num_experts).float()
    bias += 0.01 * torch.sign(mean_load - load)  # training-time rule, shown for illustration
    imbalance.append(float(load.max() / mean_load))
idx_b, w_b = route(logits, g, bias=bias)
hist_b = expert_histogram(idx_b, g.num_experts)
scores = torch.nn.functional.softplus(logits).sqrt()
w_check = scores.gather(1, idx_b)
w_check = w_check / w_check.sum(1, keepdim=True) * g.routed_scaling
print(f"max/mean load: {imbalance[0]:.2f} without bias -> {hist_b.max() / mean_load:.2f} with the bias")
print(f"weights still from unbiased scores: max |diff| = {(w_b - w_check).abs().max():.2e}")

# %%
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 3.4), gridspec_kw={"width_ratios": [3, 1]})
ax0.bar(range(g.num_experts), hist.numpy(), width=1.0, alpha=0.5, label="no bias")
ax0.bar(range(g.num_experts), hist_b.numpy(), width=1.0, alpha=0.7, label="with noaux_tc bias")
ax0.axhline(mean_load, color="k", ls="--", lw=1)
ax0.set(xlabel="expert", ylabel="rows routed", title="selection bias flattens the histogram")
ax0.legend()
ax1.plot(imbalance, marker=".")
ax1.set(xlabel="bias update step", ylabel="max / mean load")
figs.save(fig, "bias_balancing")

# %% [markdown]
# ## 1.3 The pool: expert-sorted, BLOCK_M-padded
#
# Dispatch copies each routed (token, slot) row into one pool sorted by expert. Each expert's segment
# is padded up to a multiple of BLOCK_M so that every M tile belongs to one expert; padding rows are
# computed by the tensor cores but never scattered back. `DispatchLayout` states the indexing equation:
# expert e owns rows `[padded_offsets[e], padded_offsets[e] + counts[e])`. A small example
# (tiny preset: E = 8, K = 2, 12 tokens, one masked slot, BLOCK_M = 8) shows it row by row.

# %%
tiny = get_geometry("tiny")
idx_small, _ = make_routing(12, tiny.num_experts, tiny.num_topk, gen=torch.Generator().manual_seed(1),
                            skew=1.0, mask_prob=0.05)
lay = build_layout([idx_small], 0, tiny.num_experts, block_m=8)
print("topk_idx (-1 = masked):", idx_small.tolist())
print("counts per expert:     ", lay.counts.tolist())
print("padded_offsets:        ", lay.padded_offsets.tolist())
print(f"pool rows {lay.num_pool_rows}, real rows {lay.num_routed_rows}, "
      f"padding {lay.num_pool_rows - lay.num_routed_rows} ({1 - lay.num_routed_rows / lay.num_pool_rows:.0%})")

# %%
expert_of_row = torch.bucketize(torch.arange(lay.num_pool_rows), lay.padded_offsets[1:], right=True)
fig, ax = plt.subplots(figsize=(12, 2.4))
cmap = plt.get_cmap("tab10")
for r in range(lay.num_pool_rows):
    real = bool(lay.is_real[r])
    ax.bar(r, 1, width=1.0, color=cmap(int(expert_of_row[r])) if real else "0.9", edgecolor="white", lw=0.5)
    if real:
        ax.text(r, 0.5, f"t{int(lay.src_token[r])}\ns{int(lay.src_slot[r])}", ha="center", va="center", fontsize=6)
for e in range(tiny.num_experts):
    lo, hi = int(lay.padded_offsets[e]), int(lay.padded_offsets[e + 1])
    if hi > lo:
        ax.text((lo + hi - 1) / 2, 1.08, f"expert {e}", ha="center", fontsize=8)
ax.set(xlim=(-0.5, lay.num_pool_rows - 0.5), ylim=(0, 1.25), yticks=[], xlabel="pool row",
       title="pool: colour = expert, grey = BLOCK_M padding (t = token, s = slot)")
ax.grid(False)
figs.save(fig, "pool_layout")

# %% [markdown]
# ## 1.4 Padding waste per BLOCK_M
#
# The waste is `padding rows / pool rows`: MMA work on rows that are thrown away. It depends on how
# many rows each expert gets, so on the token count: at a few tokens per expert almost every tile is
# mostly padding, at thousands it vanishes. FlashInfer's SM90 plans use BLOCK_M 8 / 24 / 64 and
# DeepGEMM 64 / 128 (docs/kernel-contract.md); here are all of them over token counts, at DeepSeek-V4-Flash
# routing with one rank owning all 256 experts, with fresh routing per point.

# %%
token_counts = [1, 8, 32, 128, 512, 2048, 8192]
block_ms = [8, 24, 64, 128]
waste = {bm: [] for bm in block_ms}
for t in token_counts:
    idx_t, _ = make_routing(t, g.num_experts, g.num_topk, gen=torch.Generator().manual_seed(100 + t), skew=0.3)
    for bm in block_ms:
        lay_t = build_layout([idx_t], 0, g.num_experts, block_m=bm)
        waste[bm].append(1 - lay_t.num_routed_rows / lay_t.num_pool_rows)
print("padding waste (fraction of pool rows) at DeepSeek-V4-Flash, EP = 1")
print("tokens " + "".join(f"{'BM=' + str(bm):>9}" for bm in block_ms))
for j, t in enumerate(token_counts):
    print(f"{t:6d} " + "".join(f"{waste[bm][j]:9.1%}" for bm in block_ms))

# %%
fig, ax = plt.subplots(figsize=(7, 4))
for bm in block_ms:
    ax.plot(token_counts, [100 * w for w in waste[bm]], marker="o", label=f"BLOCK_M {bm}")
ax.set(xscale="log", xlabel="tokens on the rank", ylabel="padding rows (% of pool)",
       title="padding waste per BLOCK_M (DeepSeek-V4-Flash routing, E=256, K=6)")
ax.legend()
figs.save(fig, "padding_waste")

# %% [markdown]
# **Takeaway.** Small steps want small BLOCK_M (few rows per expert), big steps want big BLOCK_M
# (fewer, fuller tiles and better weight reuse). That is why the kernel picks its plan from the token
# count, and why every rank of one launch must agree on it (notebook 05 and 06).
