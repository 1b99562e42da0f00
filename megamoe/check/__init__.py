"""``megamoe check``: run one preset through every stage of every recipe on this machine (CPU is fine)
and say, per stage, how far each kernel recipe lands from ``exact``; fail loudly on a sanity breach.

    report = run_check(preset="small", tokens=64, seed=0, block_m=8, ranks=2)   # 64 tokens on each rank
    report.ok            # every sanity check passed (EP == one rank, BLOCK_M-invariant, no NaN, ...)
    report.to_dict()     # what --out writes (check.json)
    render([report])     # the rich tables ``megamoe check`` prints (megamoe.check.render)

    matrix.py    a fused backend's differential matrix (``megamoe check --backends NAME``)
    prepare.py   the weights made once for every token count, and the estimate of what the check costs
    cli.py       the ``megamoe check`` command line

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
    backends: list[tuple[str, bool, str]] | None = None  # availability of every fused backend here
    backend_results: dict[str, list[dict]] = field(default_factory=dict)  # backend -> its matrix rows

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
def _staged_value(pool_x: torch.Tensor, pool_sf: torch.Tensor | None) -> torch.Tensor:
    if pool_sf is None:
        return pool_x.double()
    p, h = pool_x.shape
    ng = pool_sf.shape[1]  # the group size spelled out: -1 is ambiguous for an empty pool (P = 0)
    return (pool_x.double().view(p, ng, h // ng) * pool_sf.double().unsqueeze(2)).view(p, h)


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
    device="cpu",
    weights=None,
    step=None,
) -> CheckReport:
    """Run ``preset`` through every stage for ``exact`` and each recipe over ``ranks`` simulated EP ranks of
    ``tokens`` tokens each; compare each stage with exact, and check EP == one rank, BLOCK_M invariance, no
    NaN, zero rows for fully masked tokens. ``weights``: a ``prepare.CheckWeights`` made once for several
    calls (None: made here); ``step(phase)`` is called after the exact run and after each recipe."""
    from .prepare import prepare_weights

    g = get_geometry(preset)
    recipes = list(recipes or DEFAULT_RECIPES)
    for r in recipes:
        get_recipe(r)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"tokens (per rank) must be an int >= 0, got {tokens!r}")
    if block_m <= 0:
        raise ValueError(f"block_m must be positive, got {block_m}")
    g.experts_per_rank(ranks)
    step = step or (lambda phase: None)
    t0 = time.perf_counter()
    cw = weights if weights is not None else prepare_weights(g, recipes, seed, device)
    raw = cw.raw
    counts = [tokens] * ranks
    inputs = []
    for r, t in enumerate(counts):
        fm = (t - 1,) if t >= 2 else ()  # one token per rank with every slot masked
        inputs.append(make_inputs(g, t, seed=seed * 7919 + r, mask_prob=0.05, fully_masked_tokens=fm,
                                  skew=0.5, outlier_channels=2, device=device))
    one = MoEInputs(*(torch.cat([getattr(i, f) for i in inputs]) for f in ("x", "topk_idx", "topk_weights")))
    hist = expert_histogram(one.topk_idx.cpu(), g.num_experts)
    seconds = {"setup": time.perf_counter() - t0}

    t0 = time.perf_counter()
    exact = moe_forward_ep(inputs, raw, "exact", g, block_m=block_m, keep_stages=True)
    seconds["exact"] = time.perf_counter() - t0
    step("exact")
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
        w = cw.by_recipe[name] if name in cw.by_recipe else weights_for_recipe(raw, name)
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
        step(name)
    return report


def _sanity_outputs(report: CheckReport, name: str, ys: list[torch.Tensor], dead: list[torch.Tensor]) -> None:
    nan = sum(int(torch.isnan(y.float()).sum()) for y in ys)
    report.sanity.append(Sanity(f"{name}: no NaN in the output", nan == 0, f"{nan} NaN" if nan else ""))
    bad = [r for r, (y, m) in enumerate(zip(ys, dead)) if m.any() and (y[m] != 0).any()]
    n_dead = int(sum(int(m.sum()) for m in dead))
    # A step of one token per rank has no fully masked token (masking it would leave nothing else to compare):
    # the check is then not applicable, and says so rather than passing on zero tokens.
    detail = f"nonzero on ranks {bad}" if bad else (f"{n_dead} token(s)" if n_dead else
                                                    "not applicable: no fully masked token at 1 token per rank")
    report.sanity.append(Sanity(f"{name}: fully masked tokens give zero rows", not bad, detail))


def backend_availability() -> list[tuple[str, bool, str]]:
    """``megamoe.fused.registry.available_backends()``: [(name, ok, why not)]."""
    from ..fused import registry

    return [tuple(b) for b in registry.available_backends()]


MATRIX_BAD = ("FAIL", "NOT DETECTED", "error", "nondeterministic")


def run_backend(report: CheckReport, name: str, json_path: str | None = None, **matrix_kwargs) -> None:
    """``--backends NAME``: the fused backend's differential matrix, when the backend runs here.
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
    report.backend_results[name] = results
    bad = [r for r in results if r.get("status") in MATRIX_BAD]
    report.sanity.append(Sanity(f"backend {name}: differential matrix", not bad,
                                f"{len(results)} cases, {len(bad)} failed or not detected: "
                                f"{[r.get('case') for r in bad][:8]}" if bad else f"{len(results)} cases, all within bounds"))
