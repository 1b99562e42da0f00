"""Notebook 06's plumbing, not library code: the drawing of its own figures and the text of its
side-by-side table, so that the notebook keeps the numbers it teaches and the pictures' code lives here.

The pictures of one CTA (warps, shared memory, pipeline, dispatch / combine, schedule) come from
``megamoe.teaching.plans_viz``; these are the rest, in the same style: each takes the axes, the notebook makes
the figure and saves it (``_nb.Figures``).

    draw_plan_vs_tokens(ax0, ax1, plan)           plan(t, num_ranks=, num_sms=) -> FlashInfer plan
    draw_tiles_per_wave(axes, waves, plan)        waves: {T: [waves] L1 tiles per wave}
    draw_stage_costs(ax0, ax1, costs)             costs: {T: {stage: (bytes, FLOPs)}}
    draw_roofline(ax0, ax1, floors, measured, ceilings, sweep_name)
                                                  floors: {T: StepFloor}; measured: {backend: ([T], [us])}
    draw_recorded_plans(ax0, ax1, plans_of, names)  plans_of: {backend: {T: plan fields}}
    draw_relaunches(ax, race, fenced)             the FP4 probe's race rows, as built and with the fences
    side_by_side_table(lut, variants, race, fenced, plans_of) -> {row: (FlashInfer, DeepGEMM FP4, DeepGEMM FP8)}
"""

from __future__ import annotations

import torch

from megamoe.layouts.plans import H20_NUM_SMS, H200_NUM_SMS
from megamoe.palette import backend_colour
from megamoe.recipe import DEEPGEMM_SM90_FP8, FLASHINFER_MXFP4


# ------------------------------------------------------------------------------------ figures
def draw_plan_vs_tokens(ax0, ax1, plan) -> None:
    """6.1: BLOCK_M over T (one H200, 8 H200 ranks, one H20); experts per wave, stages and swap-AB over T."""
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


def draw_tiles_per_wave(axes, waves: dict, plan) -> None:
    """6.2: one panel per T, the L1 tiles of each wave against the H200's SMs."""
    for ax, (t, per_wave) in zip(axes, waves.items()):
        ax.bar(range(per_wave.numel()), per_wave.numpy(), color=backend_colour("flashinfer-mxfp4"))
        ax.axhline(H200_NUM_SMS, color="r", ls="--", lw=1, label="132 SMs")
        ax.set(xlabel="wave", ylabel="L1 tiles", title=f"T = {t}: BLOCK_M {plan(t).block_m}, {plan(t).num_experts_per_wave} experts/wave")
        ax.legend(fontsize=8, loc="lower right", framealpha=0.9)


def draw_stage_costs(ax0, ax1, costs: dict) -> None:
    """6.3: bytes (ax0) and FLOPs (ax1) per stage, one bar per token count of ``costs`` (three of them)."""
    stages = list(next(iter(costs.values())))
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


def draw_roofline(ax0, ax1, floors: dict, measured: dict, ceilings, sweep_name: str) -> None:
    """6.5: the roof of the measured ceilings with each T's floor on it (ax0); the floor against the
    sweep's measured kernel times over T (ax1)."""
    ai = torch.logspace(-1, 4, 200)
    roof = torch.minimum(ai * ceilings.copy_gbps * 1e9, torch.tensor(ceilings.fp8_tflops * 1e12)) / 1e12
    ax0.plot(ai.numpy(), roof.numpy(), "k-", label="H200 roof (measured ceilings)")
    for t, f in floors.items():
        inten = f.flops / f.bytes
        ax0.scatter([inten], [f.flops / (f.floor_us * 1e-6) / 1e12], s=20, color="k")
        if t in (1, 8, 32, 128, 512, 2048, 8192):
            ax0.annotate(str(t), (inten, f.flops / (f.floor_us * 1e-6) / 1e12), fontsize=7, xytext=(3, -8), textcoords="offset points")
    ax0.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP / byte)", ylabel="TFLOP/s at the floor",
            title="roofline: each point a token count T")
    ax0.legend(fontsize=8)
    ax1.plot(list(floors), [f.floor_us for f in floors.values()], "k--", marker="o", label="MXFP4 floor (this notebook's model)")
    for backend, (ts, us) in measured.items():
        ax1.plot(ts, us, marker=".", color=backend_colour(backend), label=backend)
    ax1.legend(fontsize=7)
    ax1.set(xscale="log", yscale="log", xlabel="tokens per rank T", ylabel="us per layer",
            title=f"the floor and the measured times ({sweep_name})")


def draw_recorded_plans(ax0, ax1, plans_of: dict, names) -> None:
    """6.10: BLOCK_M (ax0) and pipeline stages (ax1) over T as each kernel printed them on the H200."""
    for b, label in zip(plans_of, names):
        ts = sorted(plans_of[b])
        for ax, key in ((ax0, "block_m"), (ax1, "num_stages")):
            ax.step(ts, [plans_of[b][t][key] for t in ts], where="post", marker=".", color=backend_colour(b), label=label)
    ax0.set(xscale="log", xlabel="tokens per rank T", ylabel="BLOCK_M", title="BLOCK_M, recorded on the H200")
    ax1.set(xscale="log", xlabel="tokens per rank T", ylabel="pipeline stages", title="stages, recorded on the H200")
    ax0.legend(fontsize=8)


def draw_relaunches(ax, race: list, fenced: list) -> None:
    """6.10: % of DeepGEMM SM90 FP4's relaunches that differ from the first, per T, as the pull request
    builds it (bars) and with megamoe's fences (crosses, at the counts the fenced run covered)."""
    ts = [r["tokens"] for r in race]
    ax.bar(range(len(ts)), [100 * r["differing_from_first"] / r["launches"] for r in race],
           color=backend_colour("deepgemm-sm90-fp4"))
    fenced_at = {r["tokens"]: r for r in fenced}
    ax.scatter([i for i, t in enumerate(ts) if t in fenced_at],
               [100 * fenced_at[t]["differing_from_first"] / fenced_at[t]["launches"] for t in ts if t in fenced_at],
               marker="x", color="black", zorder=3, label="with megamoe's fences")
    ax.legend(fontsize=7)
    ax.set_xticks(range(len(ts)), ts, rotation=60, fontsize=7)
    ax.set(xlabel="tokens per rank T", ylabel="% of launches differing from the first",
           title="DeepGEMM SM90 FP4: relaunches of one input (H200)")


# ------------------------------------------------------------------------------------ 6.10 table
def span(values) -> str:
    """A contiguous run of ints -> 'a..b' (checked: a gap would be hidden)."""
    lo, hi = min(values), max(values)
    assert sorted(values) == list(range(lo, hi + 1)), values
    return f"{lo}..{hi}"


def by_tokens(pairs) -> str:
    """[(T, value)] by T -> 'value (T a..b), ...' over the recorded counts."""
    runs = []
    for t, v in sorted(pairs):
        if runs and runs[-1][0] == v:
            runs[-1][2] = t
        else:
            runs.append([v, t, t])
    return ", ".join(f"{v} (T {a}..{b})" if a != b else f"{v} (T {a})" for v, a, b in runs)


def codes_identical(variants: list, reference: str, digits: int = 0) -> str:
    """Range over the probe's cases of the L2-input FP8 codes identical to a reference variant's, in %."""
    vals = [100 * v[reference]["code_match"] for v in variants]
    return f"{min(vals):.{digits}f}-{max(vals):.{digits}f}%"


def side_by_side_table(lut: dict, variants: list, race: list, fenced: list, plans_of: dict) -> dict:
    """The rows of 6.10's table, each a cell per kernel in ``plans_of``'s order (FlashInfer MXFP4,
    DeepGEMM SM90 FP4, DeepGEMM SM90 FP8), each cell marked with where its fact comes from.

    lut, variants, race: the FP4 probe's decode table, reference variants and relaunches (as the pull
    request builds it); fenced: the relaunches with megamoe's proxy fences; plans_of: {backend: {T: plan}}.
    """
    racy = [(r["tokens"], r["differing_from_first"], r["launches"]) for r in race if r["differing_from_first"]]
    steady = [r["tokens"] for r in race if not r["differing_from_first"]]
    hi = lut["window_measured"][1]
    fi, dg = FLASHINFER_MXFP4, DEEPGEMM_SM90_FP8
    table = {
        "weights": ("MXFP4: e2m1 + one E8M0 byte per 32", "MXFP4: e2m1 + one UE8M0 byte per 32",
                    "e4m3 + one FP32 scale per 128 x 128 block"),
        "FP4 -> e4m3 decode": (
            "e4m3, flushed to 0 below 2^-6, saturated at 448 [recipe: e4m3_flush_saturate]",
            f"a table: e4m3 round-to-nearest of e2m1 x 2^(b-127) for bytes {span(lut['bytes_matching_e4m3_rn_model'])} "
            f"(all codes 0 for bytes {span(lut['all_zero_bytes'])}), wraps into negative / NaN above {hi} [measured]",
            "none"),
        "exact scale bytes": (
            f"{fi.min_scale_byte}..{fi.max_scale_byte}, the rest moved into per-expert global scales [recipe]",
            f"{span(lut['bytes_all_codes_exact'])}: every code of every byte exact; no global scales [measured]", "-"),
        "L2 requant group, scale": (
            f"{fi.l2_group} channels, power of two (ceil) [recipe, measured]",
            f"64 channels, power of two (ceil): {codes_identical(variants, 'base-tc', 2)} of L2-input codes identical; "
            f"group 128 gives {codes_identical(variants, 'group128')}, a continuous scale "
            f"{codes_identical(variants, 'continuous')} [measured]",
            f"{dg.l2_group} channels, continuous amax / 448 [recipe, measured]"),
    }
    for row, key in (("BLOCK_M", "block_m"), ("stages", "num_stages"), ("swap-AB", "swap_ab")):
        table[f"{row} (DeepSeek-V4-Flash, one H200)"] = tuple(
            by_tokens((t, p[key]) for t, p in plans_of[b].items()) + " [recorded]" for b in plans_of)
    table["identical relaunches"] = (
        "not checked", "as pull request #323: differ at T " + ", ".join(f"{t} ({n}/{m} launches)" for t, n, m in racy)
        + f", bit-identical at T {', '.join(map(str, steady))}; with megamoe's fences: "
        + ", ".join(f"T {r['tokens']} {r['differing_from_first'] + r['alternating_differing_from_first']}/{2 * r['launches']}"
                    for r in fenced) + " [measured]", "not checked")
    return table
