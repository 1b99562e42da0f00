"""``megamoe check``: run one preset through every stage of every recipe on this machine (CPU is fine)
and say, per stage, how far each kernel recipe lands from ``exact``; fail loudly on a sanity breach.

    report = run_check(preset="small", tokens=64, seed=0, block_m=8, ranks=2)
    report.ok            # every sanity check passed (EP == one rank, BLOCK_M-invariant, no NaN, ...)
    report.to_dict()     # what --json writes
    render(report)       # the rich tables ``megamoe check`` prints

Stages compared against the ``exact`` recipe (same routing, same pool rows):
    x       staged activations, dequantized (e4m3 * scale)        [P, H]
    L1      gate | up accumulators (after FlashInfer's gs1)         [P, 2I]
    L2 in   requantized SwiGLU * routing weight, dequantized       [P, I]
    L2 out  per (token, slot) expert output                        [P, H]
    y       combined output                                        [T, H]
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from ..geometry import get_geometry
from ..inputs import MoEInputs, make_inputs
from ..recipe import RECIPES, get_recipe
from ..reference.pipeline import moe_forward, moe_forward_ep
from ..reference.routing import expert_histogram
from ..testing import calc_diff, first_mismatch, rel_l2, weights_for_recipe
from ..weights import random_mxfp4_weights

DEFAULT_RECIPES = tuple(r for r in RECIPES if r != "exact")
# calc_diff of the combined output vs exact above which a recipe is reported as a failure. The FP8
# requant error alone is ~4e-4 (KERNELS.md); anything near 1e-2 means a stage is broken.
MAX_OUTPUT_DIFF = 5e-3
STAGES = ("x", "L1", "L2 in", "L2 out", "y")


@dataclass
class Sanity:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class StageError:
    recipe: str
    stage: str
    shape: tuple[int, ...]
    calc_diff: float
    rel_l2: float


@dataclass
class CheckReport:
    preset: str
    geometry: dict
    tokens_per_rank: list[int]
    seed: int
    block_m: int
    ranks: int
    recipes: list[str]
    expert_rows: list[int]  # rows routed to each expert (all ranks)
    pool_rows: list[dict]  # per destination rank: routed rows, padded rows
    stage_shapes: dict[str, tuple[int, ...]]
    errors: list[StageError] = field(default_factory=list)
    sanity: list[Sanity] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    backends: list[tuple[str, bool, str]] | None = None  # None: no fused registry installed
    backend_results: list[dict] | None = None

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.sanity)

    def histogram(self) -> dict:
        rows = self.expert_rows
        return {
            "min": min(rows), "median": statistics.median(rows), "max": max(rows),
            "empty_experts": [e for e, n in enumerate(rows) if n == 0],
        }

    def error(self, recipe: str, stage: str) -> StageError | None:
        return next((e for e in self.errors if e.recipe == recipe and e.stage == stage), None)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        d["histogram"] = self.histogram()
        return d


# ------------------------------------------------------------------------------------ running
def split_tokens(tokens: int, ranks: int) -> list[int]:
    """Ragged per-rank counts summing to ``tokens``: rank 0 gets the remainder and the last rank is
    light (uneven on purpose, as real data-parallel steps are); a single rank gets them all."""
    if ranks == 1:
        return [tokens]
    base = [tokens // ranks] * ranks
    base[0] += tokens % ranks
    shift = base[-1] // 2
    base[-1] -= shift
    base[0] += shift
    return base


def _staged_value(pool_x: torch.Tensor, pool_sf: torch.Tensor | None) -> torch.Tensor:
    if pool_sf is None:
        return pool_x.double()
    p, h = pool_x.shape
    return (pool_x.double().view(p, pool_sf.shape[1], -1) * pool_sf.double().unsqueeze(2)).view(p, h)


def _dequant_l2_in(q: torch.Tensor, sf: torch.Tensor | None) -> torch.Tensor:
    return _staged_value(q.float(), sf)


def _stage_tensors(res, ranks: int) -> dict[str, torch.Tensor]:
    """Per stage, the real pool rows of every destination rank stacked (same order for any recipe)."""
    out = {s: [] for s in STAGES[:-1]}
    for st in res.ranks:
        real = st.layout.is_real
        out["x"].append(_staged_value(st.pool_x, st.pool_x_sf)[real])
        out["L1"].append(st.l1_out.double()[real])
        out["L2 in"].append(_dequant_l2_in(st.l2_in, st.l2_in_sf)[real])
        out["L2 out"].append(st.l2_out.double()[real])
    d = {k: torch.cat(v) for k, v in out.items()}
    d["y"] = torch.cat([y.double() for y in res.y])
    return d


def run_check(
    preset: str = "small",
    tokens: int = 64,
    seed: int = 0,
    block_m: int = 8,
    ranks: int = 1,
    recipes: "list[str] | tuple[str, ...] | None" = None,
    max_output_diff: float = MAX_OUTPUT_DIFF,
) -> CheckReport:
    """Run ``preset`` through every stage for ``exact`` and each recipe over ``ranks`` simulated EP
    ranks; compare each stage with exact, and check EP == one rank, BLOCK_M invariance, no NaN,
    zero rows for fully masked tokens."""
    g = get_geometry(preset)
    recipes = list(recipes or DEFAULT_RECIPES)
    for r in recipes:
        get_recipe(r)
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    if block_m <= 0:
        raise ValueError(f"block_m must be positive, got {block_m}")
    g.experts_per_rank(ranks)
    t0 = time.perf_counter()
    raw = random_mxfp4_weights(g, seed=seed)
    counts = split_tokens(tokens, ranks)
    inputs = []
    for r, t in enumerate(counts):
        fm = (t - 1,) if t >= 2 else ()  # one token per rank with every slot masked
        inputs.append(make_inputs(g, t, seed=seed * 7919 + r, mask_prob=0.05, fully_masked_tokens=fm,
                                  skew=0.5, outlier_channels=2))
    one = MoEInputs(*(torch.cat([getattr(i, f) for i in inputs]) for f in ("x", "topk_idx", "topk_weights")))
    hist = expert_histogram(one.topk_idx, g.num_experts)
    seconds = {"setup": time.perf_counter() - t0}

    t0 = time.perf_counter()
    exact = moe_forward_ep(inputs, raw, "exact", g, block_m=block_m, keep_stages=True)
    seconds["exact"] = time.perf_counter() - t0
    ref = _stage_tensors(exact, ranks)
    el = g.experts_per_rank(ranks)
    pool_rows = [{"rank": d, "experts": f"{d * el}..{(d + 1) * el - 1}", "routed": st.layout.num_routed_rows,
                  "pool": st.layout.num_pool_rows} for d, st in enumerate(exact.ranks)]
    report = CheckReport(
        preset=preset, geometry=asdict(g), tokens_per_rank=counts, seed=seed, block_m=block_m, ranks=ranks,
        recipes=["exact", *recipes], expert_rows=hist.tolist(), pool_rows=pool_rows,
        stage_shapes={k: tuple(v.shape) for k, v in ref.items()}, seconds=seconds,
    )
    dead = [(inp.topk_idx < 0).all(dim=1) for inp in inputs]
    _sanity_outputs(report, "exact", exact.y, dead)

    for name in recipes:
        t0 = time.perf_counter()
        w = weights_for_recipe(raw, name)
        res = moe_forward_ep(inputs, w, name, g, block_m=block_m, keep_stages=True)
        report.seconds[name] = time.perf_counter() - t0
        got = _stage_tensors(res, ranks)
        for stage in STAGES:
            report.errors.append(StageError(name, stage, tuple(got[stage].shape), calc_diff(got[stage], ref[stage]),
                                            rel_l2(got[stage], ref[stage])))
        _sanity_outputs(report, name, res.y, dead)
        d = report.error(name, "y").calc_diff
        report.sanity.append(Sanity(f"{name}: output calc_diff vs exact <= {max_output_diff:.0e}", d <= max_output_diff,
                                    f"{d:.3e}"))
        # One rank, BLOCK_M 1, on the concatenated step: the EP result must be the same bits.
        y_one = moe_forward(one, w, name, g, block_m=1)
        msg = first_mismatch(torch.cat(res.y), y_one)
        label = f"{name}: EP R={ranks} BLOCK_M={block_m} == one rank BLOCK_M=1"
        report.sanity.append(Sanity(label, not msg, msg or "bit-identical"))
    return report


def _sanity_outputs(report: CheckReport, name: str, ys: list[torch.Tensor], dead: list[torch.Tensor]) -> None:
    nan = sum(int(torch.isnan(y.float()).sum()) for y in ys)
    report.sanity.append(Sanity(f"{name}: no NaN in the output", nan == 0, f"{nan} NaN" if nan else ""))
    bad = [r for r, (y, m) in enumerate(zip(ys, dead)) if m.any() and (y[m] != 0).any()]
    n_dead = int(sum(int(m.sum()) for m in dead))
    report.sanity.append(Sanity(f"{name}: fully masked tokens give zero rows", not bad,
                                f"nonzero on ranks {bad}" if bad else f"{n_dead} token(s)"))


def backend_availability() -> list[tuple[str, bool, str]] | None:
    """``megamoe.fused.registry.available_backends()`` or None when no fused registry is installed."""
    try:
        from ..fused import registry
    except ImportError:
        return None
    return [tuple(b) for b in registry.available_backends()]


MATRIX_BAD = ("FAIL", "NOT DETECTED", "error")


def run_backend(report: CheckReport, name: str, json_path: str | None = None, **matrix_kwargs) -> None:
    """``--backend NAME``: the fused backend's differential matrix, when the backend runs here.
    ``matrix_kwargs`` go to ``megamoe.check.matrix.run_matrix`` (mma, ref_max_tokens, quick, ...)."""
    avail = report.backends
    if avail is None:
        report.sanity.append(Sanity(f"backend {name}", False, "no fused backends are installed (megamoe.fused.registry)"))
        return
    entry = next((b for b in avail if b[0] == name), None)
    if entry is None:
        report.sanity.append(Sanity(f"backend {name}", False, f"unknown backend; known: {[b[0] for b in avail]}"))
        return
    if not entry[1]:
        report.sanity.append(Sanity(f"backend {name}", False, f"not available here: {entry[2]}"))
        return
    from .matrix import run_matrix

    results = run_matrix(name, out_json=json_path, **matrix_kwargs)
    report.backend_results = results
    bad = [r for r in results if r.get("status") in MATRIX_BAD]
    report.sanity.append(Sanity(f"backend {name}: differential matrix", not bad,
                                f"{len(results)} cases, {len(bad)} failed or not detected: "
                                f"{[r.get('case') for r in bad][:8]}" if bad else f"{len(results)} cases, all within bounds"))


# ------------------------------------------------------------------------------------ printing
def _fmt(x: float) -> str:
    return "0" if x == 0 else f"{x:.2e}"


def render(report: CheckReport, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    g = report.geometry
    h = report.histogram()
    empty = h["empty_experts"]
    console.print(
        f"[bold]megamoe check[/bold] preset [cyan]{report.preset}[/cyan] (E={g['num_experts']}, K={g['num_topk']}, "
        f"H={g['hidden']}, I={g['intermediate']}), tokens per rank {report.tokens_per_rank}, ranks {report.ranks}, "
        f"BLOCK_M {report.block_m}, seed {report.seed}"
    )
    console.print(
        f"rows per expert: min {h['min']} / median {h['median']:g} / max {h['max']}; "
        f"empty experts: {len(empty)}{(' ' + str(empty[:16]) + (' ...' if len(empty) > 16 else '')) if empty else ''}"
    )
    pools = Table(title="dispatch pools (simulated EP ranks)")
    for col in ("rank", "experts", "routed rows", "pool rows (padded)"):
        pools.add_column(col, justify="right")
    for p in report.pool_rows:
        pools.add_row(str(p["rank"]), p["experts"], str(p["routed"]), str(p["pool"]))
    console.print(pools)

    kernel = [r for r in report.recipes if r != "exact"]
    table = Table(title="error vs the exact recipe per stage: calc_diff / rel_l2")
    table.add_column("stage")
    table.add_column("shape", justify="right")
    for r in kernel:
        table.add_column(r, justify="right")
    for stage in STAGES:
        cells = []
        for r in kernel:
            e = report.error(r, stage)
            cells.append("-" if e is None else f"{_fmt(e.calc_diff)} / {_fmt(e.rel_l2)}")
        table.add_row(stage, "x".join(map(str, report.stage_shapes[stage])), *cells)
    console.print(table)

    sanity = Table(title="sanity checks")
    for col in ("check", "result", "detail"):
        sanity.add_column(col)
    for s in report.sanity:
        sanity.add_row(s.name, "[green]ok[/green]" if s.ok else "[red]FAIL[/red]", s.detail)
    console.print(sanity)

    if report.backends is None:
        console.print("fused backends: none installed (megamoe.fused.registry not importable)")
    else:
        bt = Table(title="fused backends")
        for col in ("backend", "available", "reason"):
            bt.add_column(col)
        for name, ok, why in report.backends:
            bt.add_row(name, "[green]yes[/green]" if ok else "[yellow]no[/yellow]", why)
        console.print(bt)
    if report.backend_results:
        mt = Table(title="differential matrix (kernel vs its faithful reference)")
        for col in ("case", "status", "calc_diff", "L2 codes", "L2 sf rel", "ref", "launch us", "plan"):
            mt.add_column(col)
        for r in report.backend_results:
            def num(k, fmt):
                v = r.get(k)
                return fmt.format(v) if isinstance(v, (int, float)) else "-"
            st = r.get("status", "")
            color = "red" if st in MATRIX_BAD else ("green" if st in ("pass", "detected") else "yellow")
            rr = r.get("reference_recipe") or {}
            mt.add_row(str(r.get("case")), f"[{color}]{st}[/{color}]", num("calc_diff", "{:.2e}"),
                       num("code_match", "{:.4f}"), num("sf_rel_median", "{:.1e}"),
                       f"{rr.get('mma', '')}/{rr.get('accumulate', '')}" if rr else "-",
                       num("launch_us", "{:.1f}"), str(r.get("plan", r.get("reason", r.get("error", ""))))[:60])
        console.print(mt)
    secs = ", ".join(f"{k} {v:.2f}s" for k, v in report.seconds.items())
    console.print(f"time: {secs}")
    console.print("[bold green]all checks passed[/bold green]" if report.ok else
                  f"[bold red]{sum(not s.ok for s in report.sanity)} check(s) FAILED[/bold red]")
