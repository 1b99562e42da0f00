"""Pictures of a fused kernel's execution, drawn from its plan (``megamoe.teaching.anatomy``): the warps of one
CTA and their roles, its shared memory and pipeline stages, the TMA -> WGMMA pipeline, the dispatch
pull and combine write-back over symmetric memory, and the persistent schedule of tasks over the SMs.

    draw_warps(ax, [anatomy, ...], labels)       one row of warps per plan, coloured by role
    draw_smem(ax, [anatomy, ...], labels)        shared-memory bytes: fixed regions + the stage ring
    pipeline_events(anatomy, k_blocks)           [(lane, k, stage, start, end)]: unit-step model
    draw_pipeline(ax, anatomy, k_blocks)
    draw_dispatch_combine(ax, geometry, ranks)   one (token, slot) row's trip between ranks
    static_schedule(...) / interleaved_schedule(...) -> [SM][step] phase codes (0 idle, 1 L1, 2 L2)
    draw_schedule(ax, grid, title)

The schedules and the pipeline are models with unit-length steps, not traces: they show the order
(which SM takes which task, which stage holds which K block), not durations. matplotlib is imported
by the callers; the functions here only take an ``ax``.
"""

from __future__ import annotations

from .anatomy import KernelAnatomy
from ..geometry import get_geometry
from ..layouts.deepgemm_configs import SM90_SMEM_CAPACITY
from ..palette import PHASE_COLOURS, backend_colour, role_colour

IDLE, L1, L2 = 0, 1, 2


def draw_warps(ax, anatomies: list[KernelAnatomy], labels: list[str]) -> None:
    """Each plan a row of warps (x: warp index), each role a bar with its name, warp count and
    registers per thread; thin lines every 4 warps mark the warpgroups setmaxnreg acts on."""
    for y, (a, label) in enumerate(zip(anatomies, labels)):
        for r in a.roles:
            ax.barh(y, r.warps, left=r.first_warp, height=0.7, color=role_colour(r.name), edgecolor="white")
            text = f"{r.name}\n{r.warps}w" + (f" {r.registers}r" if r.registers else "")
            ax.text(r.first_warp + r.warps / 2, y, text, ha="center", va="center", fontsize=6.5)
        for wg in range(0, a.warps + 1, 4):
            ax.plot([wg, wg], [y - 0.4, y + 0.4], color="k", lw=0.6)
        ax.text(a.warps + 0.3, y, f"{a.threads} threads", va="center", fontsize=7)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_xlim(0, max(a.warps for a in anatomies) + 4)
    ax.invert_yaxis()
    ax.set(xlabel="warp index in the CTA (one CTA per SM)")
    ax.grid(False)


def draw_smem(ax, anatomies: list[KernelAnatomy], labels: list[str]) -> None:
    """Bytes of shared memory per plan: the fixed regions (grey), then stage 0..S-1 of the ring
    (A, B and scale tiles, each stage one shade), the SM90 capacity, and (dashed) the combine
    phase's ring where the kernel reuses the region for it."""
    kb = 1 / 1024
    for y, (a, label) in enumerate(zip(anatomies, labels)):
        left = 0.0
        for r in (r for r in a.regions if not r.per_stage and r.bytes):
            ax.barh(y, r.bytes * kb, left=left, height=0.6, color="0.75", edgecolor="white", lw=0.5)
            left += r.bytes * kb
        for s in range(a.num_stages):
            ax.barh(y, a.stage_bytes * kb, left=left, height=0.6, color=backend_colour(a.kernel),
                    alpha=0.45 + 0.5 * (s % 2), edgecolor="white", lw=0.5)
            ax.text(left + a.stage_bytes * kb / 2, y, f"s{s}", ha="center", va="center", fontsize=6.5)
            left += a.stage_bytes * kb
        if a.combine_ring_bytes:
            ax.barh(y, a.combine_ring_bytes * kb, height=0.8, fill=False, ls="--", edgecolor="k", lw=0.8)
        ax.text(left + 2, y, f"{a.num_stages} x {a.stage_bytes / 1024:.1f} KB", va="center", fontsize=7)
    ax.axvline(SM90_SMEM_CAPACITY * kb, color="r", lw=1, ls=":", label="SM90 capacity (227 KB)")
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel="KB of shared memory per CTA", xlim=(0, SM90_SMEM_CAPACITY * kb * 1.25))
    ax.legend(fontsize=7, loc="lower right")


def pipeline_events(a: KernelAnatomy, k_blocks: int, load_steps: int = 4) -> list[tuple[str, int, int, int, int]]:
    """The mainloop of one task as [(lane, k, stage, start, end)] with unit steps: the TMA warps issue
    K block k into stage k % S once the math warps released that stage (k - S done); the load arrives
    ``load_steps`` later (an assumed latency, in units of one K block of WGMMA); the decode warps (where
    the plan has them) turn it into e4m3 in one step; one step of WGMMA consumes it and frees the stage.
    With S stages at most S loads are in flight: S <= load_steps leaves the WGMMA waiting."""
    s = a.num_stages
    load = load_steps
    decode = any(r.name == "decode" for r in a.roles)
    freed = [0] * s  # when each stage was last released
    events, issue, mma_end, dec_end = [], 0, 0, 0
    for k in range(k_blocks):
        st = k % s
        issue = max(issue, freed[st])
        ready = issue + max(load, 1)
        events.append(("TMA load", k, st, issue, ready))
        if decode:
            d0 = max(ready, dec_end)
            dec_end = d0 + 1
            events.append(("decode", k, st, d0, dec_end))
            ready = dec_end
        m0 = max(ready, mma_end)
        mma_end = m0 + 1
        events.append(("WGMMA", k, st, m0, mma_end))
        freed[st] = mma_end
        issue += 1  # one issue per step
    return events


def draw_pipeline(ax, a: KernelAnatomy, k_blocks: int, title: str = "") -> None:
    lanes = ["TMA load", "decode", "WGMMA"]
    lanes = [ln for ln in lanes if ln != "decode" or any(r.name == "decode" for r in a.roles)]
    colour = {"TMA load": role_colour("TMA B"), "decode": role_colour("decode"), "WGMMA": role_colour("math")}
    for lane, k, st, t0, t1 in pipeline_events(a, k_blocks):
        y = lanes.index(lane) + (st / a.num_stages * 0.6 - 0.3 if lane == "TMA load" else 0)
        h = 0.6 / a.num_stages if lane == "TMA load" else 0.6
        ax.barh(y, t1 - t0, left=t0, height=h, color=colour[lane], alpha=0.4 + 0.6 * (k % 2), edgecolor="k", lw=0.3)
        if lane != "TMA load" or a.num_stages <= 4:
            ax.text((t0 + t1) / 2, y, str(k), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(lanes)), [ln if ln != "TMA load" else f"TMA load\n(stage 0..{a.num_stages - 1})"
                                      for ln in lanes], fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel="step (model: one K block of WGMMA per step)", title=title)


def draw_dispatch_combine(ax, geometry, num_ranks: int = 4, num_tokens: int = 1) -> None:
    """R ranks, each with its staged input, its pool of received rows and its combine buffer (K slots
    of bf16 rows). Arrows: rank 0's dispatch warps pull a routed row from rank 2's input over NVLink;
    the L2 epilogue writes the expert's output row back into rank 2's combine slot; rank 2's combine
    warps sum its K slots into y. Byte counts are the geometry's."""
    from matplotlib.patches import FancyArrowPatch, Rectangle

    g = get_geometry(geometry)
    pull = g.hidden + g.hidden // 128 * 4 + 4  # FP8 row + per-128 scales + the routing weight
    back = g.hidden * 2
    boxes = {}
    for r in range(num_ranks):
        x = r * 3.0
        for j, (name, colour) in enumerate((("input x, x_sf, top-k", role_colour("dispatch")),
                                            ("pool (rows of local experts)", role_colour("TMA A")),
                                            (f"combine: {g.num_topk} slots x [T, H] bf16", role_colour("math")))):
            y = 2.0 - j * 1.0
            ax.add_patch(Rectangle((x, y), 2.4, 0.7, color=colour, alpha=0.35))
            ax.text(x + 1.2, y + 0.35, name, ha="center", va="center", fontsize=6.5)
            boxes[r, j] = (x, y)
        ax.text(x + 1.2, 2.95, f"rank {r}: experts {r * g.num_experts // num_ranks}..{(r + 1) * g.num_experts // num_ranks - 1}",
                ha="center", fontsize=7)

    def arrow(a, b, text, colour, at):
        ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=10, color=colour, lw=1.4))
        ax.text(*at, text, ha="center", va="center", fontsize=6.5, color=colour,
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})

    src, dst = 1, 0  # a token of rank 1 routed to an expert of rank 0
    (sx, sy), (dx, dy), (cx, cy) = boxes[src, 0], boxes[dst, 1], boxes[src, 2]
    arrow((sx + 0.3, sy), (dx + 2.2, dy + 0.7), f"dispatch: rank 0 pulls {pull} B (FP8 row, scales, weight)",
          role_colour("dispatch"), (1.5, 1.85))
    arrow((dx + 2.2, dy), (cx + 0.3, cy + 0.7), f"L2 epilogue writes {back} B (bf16 row) into slot k",
          role_colour("math"), (1.5, 0.85))
    ax.text(cx + 1.2, cy - 0.3, f"rank 1 combines: FP32 sum of its {g.num_topk} slots, one bf16 rounding -> y",
            ha="center", fontsize=6.5)
    ax.set(xlim=(-0.3, num_ranks * 3.0), ylim=(-0.6, 3.2))
    ax.axis("off")


def _tasks(counts, block_m: int, n_blocks: int) -> list[tuple[int, int]]:
    """[(expert, m_block)] x n_blocks in scheduler order, for experts with rows [E_l]."""
    return [(e, m) for e, c in enumerate(counts) for m in range(-(-int(c) // block_m)) for _ in range(n_blocks)]


def static_schedule(counts, a: KernelAnatomy, geometry, num_sms: int) -> list[list[int]]:
    """The wave scheduler (DeepGEMM; FlashInfer's static variant): per wave of num_experts_per_wave
    experts, every L1 task (m block x N block of 2I), then every L2 task (of H); SM i takes task
    i, i + num_sms, ... of that sequence, one per step."""
    g = get_geometry(geometry)
    seq = []
    for w in range(0, len(counts), a.num_experts_per_wave):
        wave = list(counts[w:w + a.num_experts_per_wave])
        seq += [L1] * len(_tasks(wave, a.block_m, 2 * g.intermediate // a.block_n))
        seq += [L2] * len(_tasks(wave, a.block_m, g.hidden // a.block_n))
    return [seq[i::num_sms] for i in range(num_sms)]


def interleaved_schedule(counts, a: KernelAnatomy, geometry, num_sms: int) -> list[list[int]]:
    """FlashInfer's interleaved scheduler (``use_interleaved_scheduler``): SMs claim tasks from two
    global counters; first enough L1 warm-up claims, then each SM alternates L2 and L1 claims, and
    an L2 task of pool block p waits (idle steps) until every L1 task of blocks 0..p was claimed."""
    g = get_geometry(geometry)
    n1, n2 = 2 * g.intermediate // a.block_n, g.hidden // a.block_n
    blocks = sum(-(-int(c) // a.block_m) for c in counts)
    first_l2 = -(-num_sms // n2)
    warm = max(-(-first_l2 * n1 // num_sms), -(-(n1 + (blocks - 1) * max(n1 - n2, 0)) // num_sms) + 1) if blocks else 0
    warm = min(warm, -(-blocks * n1 // num_sms))
    state = [warm] * num_sms  # L1 claims each SM makes before its next L2 claim
    c1 = c2 = 0
    grid = [[] for _ in range(num_sms)]
    while c2 < blocks * n2:
        for sm in range(num_sms):
            if state[sm] > 0 and c1 < blocks * n1:
                state[sm] -= 1
                c1 += 1
                grid[sm].append(L1)
            elif c2 < blocks * n2 and c1 >= min((c2 // n2 + 1) * n1, blocks * n1):
                c2 += 1
                state[sm] = 1
                grid[sm].append(L2)
            else:
                grid[sm].append(IDLE)
    return grid


def draw_schedule(ax, grid: list[list[int]], title: str) -> None:
    from matplotlib.colors import ListedColormap

    steps = max(len(row) for row in grid)
    img = [row + [IDLE] * (steps - len(row)) for row in grid]
    cmap = ListedColormap([PHASE_COLOURS["idle"], PHASE_COLOURS["L1"], PHASE_COLOURS["L2"]])
    ax.imshow(img, aspect="auto", interpolation="nearest", cmap=cmap, vmin=0, vmax=2)
    busy = sum(v != IDLE for row in img for v in row) / max(1, len(img) * steps)
    ax.set(xlabel="step (one task per SM per step)", ylabel="SM")
    ax.set_title(f"{title}: {steps} steps, {busy:.0%} busy", fontsize=8)
    ax.grid(False)
