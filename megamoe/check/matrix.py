"""The differential test matrix: each case runs one backend and its faithful reference and compares
the output (calc_diff) and, where the kernel exposes them, the L2-input FP8 codes and scales.

Cases are ``Case`` dataclasses with readable ids (``dsv4-flash-T128-bm24-ragged``). The reference of a
case does not depend on BLOCK_M, so it is computed once and reused by every forced BLOCK_M variant.
Broken variants (gate/up not interleaved, L2 scales one exponent high) are cases that must FAIL the
bound: ``detected`` is recorded for them.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
import traceback
from dataclasses import dataclass

import torch

MAX_DIFF = 1e-5
MIN_CODE_MATCH = 0.99
TOKENS = (1, 2, 7, 64, 128, 300, 512, 2048, 8192)
# Backends whose layouts _break knows how to break (or that break their own: ``break_layout``).
BROKEN_CASES_FOR = ("flashinfer-mxfp4", "deepgemm-sm90-fp8", "deepgemm-sm90-fp4", "humming-w4a8", "humming-w4a16")
# Backends whose weight window is relative to each tensor's largest byte (Humming W4A8): their lossy cases
# lower a few groups of every tensor below it ("below-window" weights).
BELOW_WINDOW_FOR = ("humming-w4a8",)


@dataclass(frozen=True)
class Case:
    geometry: str
    num_tokens: int
    block_m: int | None = None  # forced BLOCK_M (None: the backend's own plan)
    routing: str = "uniform"  # uniform | masked | allmasked | empty-expert | skewed
    ragged: tuple[int, ...] = ()  # per-rank counts of a data-parallel step; this rank runs num_tokens padded to max
    weights: str = "random"  # random | checkpoint | lossy (real-like scales below the window, accepted) | below-window
    broken: str = ""  # "" | gate-up-not-interleaved | scale-off-by-one
    seed: int = 0

    @property
    def id(self) -> str:
        parts = [self.geometry, f"T{self.num_tokens}", f"bm{self.block_m}" if self.block_m else "auto"]
        if self.routing != "uniform":
            parts.append(self.routing)
        if self.ragged:
            parts.append("ragged" + "x".join(map(str, self.ragged)))
        if self.weights != "random":
            parts.append(self.weights)
        if self.broken:
            parts.append("BROKEN-" + self.broken)
        return "-".join(parts)

    @property
    def launch_tokens(self) -> int:
        return max(self.ragged) if self.ragged else self.num_tokens

    def routing_kwargs(self) -> dict:
        return {
            "uniform": {},
            "masked": {"mask_prob": 0.3},
            "allmasked": {"fully_masked_tokens": tuple(range(0, self.num_tokens, 5))},
            "empty-expert": {"empty_experts": (0, 1, 7)},
            "skewed": {"skew": 1.5},
        }[self.routing]

    def ref_key(self) -> tuple:
        return (self.geometry, self.num_tokens, self.routing, self.weights, self.seed)


def default_cases(backend_name: str, legal_block_ms=(), allows_zero=False, quick: bool = False,
                  max_tokens: int | None = None) -> list[Case]:
    """The matrix of one backend; ``max_tokens`` drops the cases a small-step kernel does not take."""
    cases = _all_cases(backend_name, legal_block_ms, allows_zero, quick)
    return cases if max_tokens is None else [c for c in cases if c.launch_tokens <= max_tokens]


def _all_cases(backend_name: str, legal_block_ms=(), allows_zero=False, quick: bool = False) -> list[Case]:
    cases: list[Case] = []
    small_tokens = (1, 2, 7, 64, 128, 300, 512)
    big_tokens = (1, 7, 128, 512, 2048, 8192) if quick else TOKENS
    if allows_zero:
        cases += [Case("small", 0), Case("dsv4-flash", 0)]
    for t in small_tokens:
        cases.append(Case("small", t, seed=t))
    for t in big_tokens:
        cases.append(Case("dsv4-flash", t, seed=t))
    legal = legal_block_ms if isinstance(legal_block_ms, dict) else {"small": legal_block_ms,
                                                                     "dsv4-flash": legal_block_ms}
    for bm in legal.get("small", ()):
        for t in (7, 64, 300):
            cases.append(Case("small", t, block_m=bm, seed=t))
    for bm in legal.get("dsv4-flash", ()):
        for t in (7, 128, 512) if not quick else (128,):
            cases.append(Case("dsv4-flash", t, block_m=bm, seed=t))
    for geo, t in (("small", 64), ("dsv4-flash", 128)):
        for r in ("masked", "allmasked", "empty-expert", "skewed"):
            cases.append(Case(geo, t, routing=r, seed=11))
        cases.append(Case(geo, t, weights="checkpoint", seed=12))
    cases += [Case("dsv4-flash", 37, ragged=(37, 128, 5, 90), seed=13), Case("small", 5, ragged=(5, 64), seed=14),
              Case("dsv4-flash", 0, ragged=(0, 64), seed=15)] if not allows_zero else \
             [Case("dsv4-flash", 37, ragged=(37, 128, 5, 90), seed=13), Case("small", 5, ragged=(5, 64), seed=14)]
    if backend_name in BROKEN_CASES_FOR:
        cases += [Case("small", 64, broken="gate-up-not-interleaved", seed=16), Case("small", 64, broken="scale-off-by-one", seed=16)]
    if backend_name == "deepgemm-sm90-fp4":  # real-like scales below its window, run under the opt-in
        cases += [Case("dsv4-flash", t, weights="lossy", seed=17) for t in (1, 128)]
    if backend_name in BELOW_WINDOW_FOR:  # groups pushed below the window, rewritten by the kernel, run under the opt-in
        cases += [Case("small", 64, weights="below-window", seed=18)]
        cases += [Case("dsv4-flash", t, weights="below-window", seed=18) for t in (1, 128)]
    return cases


def selected_cases(backend_name: str, preset: str, tokens) -> list[Case]:
    """The matrix at one geometry and the given token counts (``megamoe check --backends NAME --preset P
    --tokens ...``): each count on the backend's own plan and at every forced BLOCK_M; the routing variants,
    checkpoint weights and a ragged step at the largest count; the broken layouts on the small preset."""
    from ..fused.registry import get_backend_class
    from ..geometry import get_geometry

    cls = get_backend_class(backend_name)
    legal = cls(get_geometry(preset), capacity=1).legal_block_ms()
    tokens = sorted(set(tokens))
    cases = [Case(preset, t, block_m=bm, seed=t) for t in tokens for bm in (None, *legal)]
    top = tokens[-1]
    cases += [Case(preset, top, routing=r, seed=11) for r in ("masked", "allmasked", "empty-expert", "skewed")]
    cases += [Case(preset, top, weights="checkpoint", seed=12), Case(preset, tokens[0], ragged=(tokens[0], top), seed=13)]
    if preset == "small" and backend_name in BROKEN_CASES_FOR:
        cases += [Case(preset, top, broken=b, seed=16) for b in ("gate-up-not-interleaved", "scale-off-by-one")]
    return cases


def _weights(preset: str, kind: str, device, cls=None):
    """Random MXFP4 weights for a case: ``cls.synthetic_weights`` moves them where the backend takes them
    (kind "lossy" keeps the real-like raw scales); "checkpoint" round-trips them through safetensors shards."""
    from ..geometry import get_geometry
    from ..weights import random_mxfp4_weights

    g = get_geometry(preset)
    w = random_mxfp4_weights(g, seed=0, device=device) if preset != "small" else random_mxfp4_weights(g, seed=0).to(device)
    if kind == "checkpoint":  # written as a model's files hold them (no global scales), then loaded back
        import tempfile

        from ..layouts.checkpoint import load_layer, write_checkpoint

        d = tempfile.mkdtemp(prefix="megamoe-ckpt-")
        write_checkpoint(d, 3, w.to("cpu"), num_files=2)
        w = load_layer(d, 3, device=device)
    if cls is not None and kind != "lossy" and cls.weight_format == "mxfp4":
        w = cls.synthetic_weights(w)
    if kind == "below-window":
        w = below_window(w)
    return g, w


def below_window(w, frac: float = 0.03, drop=(12, 13, 14, 16), seed: int = 0):
    """About ``frac`` of the groups of every (expert, tensor), their bytes lowered by one of ``drop`` binades
    (never below 1), so that they fall under Humming's W4A8 window of 12 bytes below each tensor's largest: each
    drop rounds the codes differently (12: halves and ties, 16: nearly all to zero). Codes are unchanged."""
    import dataclasses

    gen = torch.Generator().manual_seed(seed)
    new = {}
    for name in ("l1_scale", "l2_scale"):
        s = getattr(w, name)
        pick = torch.rand(s.shape, generator=gen) < frac
        by = torch.tensor(drop)[torch.randint(len(drop), s.shape, generator=gen)]
        lowered = (s.cpu().to(torch.int16) - torch.where(pick, by, torch.zeros_like(by))).clamp(min=1)
        new[name] = lowered.to(torch.uint8).to(s.device)
    return dataclasses.replace(w, **new)


def _break(be, case: Case):
    """Swap the backend's device weights for a deliberately broken layout; returns a restore fn.

    gate-up-not-interleaved: the kernel gets gate | up rows where it expects them interleaved (by 8 for
    DeepGEMM, FlashInfer's own order otherwise); scale-off-by-one: the L2 weight scales one binade high."""
    if hasattr(be, "break_layout"):  # a backend that knows its own layout breaks it itself
        return be.break_layout(case.broken)
    kw = be.kernel_weights
    old = (be.l1, be.l2)
    if be.weight_format == "fp8_block":  # DeepGEMM SM90 FP8: ((l1, l1_sf), (l2, l2_sf))
        if case.broken == "gate-up-not-interleaved":
            be.l1 = (kw.l1.contiguous(), kw.l1_scale.contiguous())
        elif case.broken == "scale-off-by-one":
            be.l2 = (kw.l2.contiguous(), (kw.l2_scale * 2).contiguous())
    elif be.name == "deepgemm-sm90-fp4":  # ((l1 uint8, l1_sf int32), (l2, l2_sf)), no global scales
        from ..formats import pack_ue8m0_x4

        if case.broken == "gate-up-not-interleaved":
            be.l1 = (kw.l1.contiguous(), pack_ue8m0_x4(kw.l1_scale))
        elif case.broken == "scale-off-by-one":
            be.l2 = (kw.l2.contiguous(), pack_ue8m0_x4((kw.l2_scale.to(torch.int16) + 1).clamp(max=254).to(torch.uint8)))
    else:
        from ..layouts._common import deinterleave_gate_up
        from ..layouts.flashinfer_sm90 import to_flashinfer_sm90

        if case.broken == "gate-up-not-interleaved":
            be.l1, _ = to_flashinfer_sm90(dataclasses.replace(kw, l1=deinterleave_gate_up(kw.l1), l1_scale=deinterleave_gate_up(kw.l1_scale)), check=False)
        elif case.broken == "scale-off-by-one":
            _, be.l2 = to_flashinfer_sm90(dataclasses.replace(kw, l2_scale=kw.l2_scale + 1), check=False)

    def restore():
        be.l1, be.l2 = old

    return restore


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time_launch(be, m: int, block_m: int | None, iters: int) -> float:
    """The launch alone in us: the median over ``iters`` calls of the CUDA events around each, after two warm-up
    calls, the L2 cache not flushed. For the table only: ``megamoe bench`` is the timing harness."""
    for _ in range(2):
        be.launch(m, block_m)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        be.launch(m, block_m)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _repeat_check(be, inp, m: int, block_m: int | None, y_first: torch.Tensor, repeats: int, t: int) -> dict:
    """Stage and launch the same step ``repeats`` more times (output poisoned each time); how many outputs
    differ from the first, in how many rows at most, and what the differing rows of the first few such
    relaunches look like (token, its routed slots, elements differing, still NaN-poisoned, largest change)."""
    from ..testing import Relaunches

    relaunches, seen = Relaunches(), []
    relaunches.add(y_first)
    slots = (inp.topk_idx[:t] >= 0).sum(dim=1)
    for n in range(repeats):
        if isinstance(getattr(be, "y", None), torch.Tensor):  # the backend's output buffer, poisoned
            be.y.fill_(float("nan"))
        be.stage(inp, m)
        y = be.launch(m, block_m)[:t]
        bad = relaunches.add(y)
        for tok in torch.nonzero(bad).flatten()[:4].tolist() if len(seen) < 4 else []:
            a, b = y[tok].float(), y_first[tok].float()
            seen.append({"relaunch": n, "token": tok, "routed_slots": int(slots[tok]),
                         "elements_differing": int((y[tok].view(torch.int16) != y_first[tok].view(torch.int16)).sum()),
                         "nan": int(torch.isnan(a).sum()), "max_abs_change": float((a - b).abs().nan_to_num(0).max()),
                         "first_row_abs_max": float(b.abs().max())})
    out = {"repeats": repeats, "repeats_differing": relaunches.changed,
           "repeat_rows_differing_max": relaunches.max_rows}
    return {**out, "repeat_rows_seen": seen} if seen else out


def _subset(inp, n: int, seed: int):
    """A sorted random subset of n tokens (the reference of a token depends only on its own rows)."""
    gen = torch.Generator().manual_seed(seed)
    sel = torch.randperm(inp.num_tokens, generator=gen)[:n].sort().values.to(inp.x.device)
    return sel, inp.select(sel)


def run_matrix(backend_name: str, cases=None, out_json: str | None = None, *, mma: str | None = None,
               time_iters: int = 20, repeats: int = 8, quick: bool = False, deadline_s: float | None = None,
               ref_max_tokens: int | None = None, log=print) -> list[dict]:
    """Run every case on one backend; returns one row per case and writes {"rows": [...]} to out_json.

    ``mma`` picks the reference's block-sum model (None: the recipe's own; "sm90-fp8-tc-operands": the
    tensor cores emulated, ``megamoe.reference.tensorcore``). The reference recipe of a case is the backend's ``recipe_for(launch tokens)``
    (DeepGEMM's accumulation mode depends on the configuration its heuristic picked).
    ``repeats``: the step is staged and launched that many more times and must give the same bits (a kernel
    that is right once but differs on a relaunch is reported ``nondeterministic``, a failure).
    ``ref_max_tokens``: above this many tokens the reference runs on a random subset of that size and
    the output / L2 codes are compared on those tokens only (rows are independent, so the subset's
    reference is bit-identical to the full one's rows; the emulated tensor cores are slow)."""
    from ..fused.build import build_plans
    from ..fused.compare import compare_l2_inputs
    from ..fused.registry import get_backend_class
    from ..inputs import make_inputs
    from ..reference import moe_forward
    from ..testing import calc_diff

    cls = get_backend_class(backend_name)
    ok, why = cls.availability()
    if not ok:
        rows = [{"backend": backend_name, "case": "all", "status": "unavailable", "reason": why}]
        _write(out_json, rows)
        return rows
    t0 = time.time()
    probe = cls(get_geometry_safe("small"), capacity=1)
    dev = probe.device  # CUDA for the kernels; a registered external backend may run on the CPU
    backends, refs, rows = {}, {}, []
    if cases is None:  # the forced BLOCK_M values of each geometry (Humming's tuning lists differ by shape)
        legal = {geo: cls(get_geometry_safe(geo), capacity=1).legal_block_ms() for geo in ("small", "dsv4-flash")}
        cases = default_cases(backend_name, legal, cls.allows_zero_tokens, quick=quick,
                              max_tokens=getattr(cls, "max_tokens_per_rank", None))
    cases = list(cases)
    # One backend (buffer, prepared weights) per (geometry, weights); every plan built before any launch.
    for c in cases:
        key = (c.geometry, c.weights)
        if key in backends:
            continue
        cap = max([x.launch_tokens for x in cases if (x.geometry, x.weights) == key] + [1])
        be = cls(get_geometry_safe(c.geometry), capacity=cap,
                 **({"accept_lossy_scales": True} if c.weights in ("lossy", "below-window") else {}))
        for x in cases:  # a BLOCK_M this backend cannot honour: refused before weights are made or a kernel runs
            if (x.geometry, x.weights) == key:
                be.resolve_block_m(x.block_m)
        g, w = _weights(c.geometry, c.weights, dev, cls)
        be.prepare(w if cls.weight_format == "mxfp4" else _fp8(w))
        be.allocate()
        backends[key] = be
    jobs, lanes = {}, {}
    for key, be in backends.items():
        for c in cases:
            if (c.geometry, c.weights) != key or c.launch_tokens <= 0:
                continue
            for k, fn in be.build_jobs([c.launch_tokens], c.block_m).items():
                jobs.setdefault((id(be), k), fn)
                lanes[(id(be), k)] = be.build_lane
    for k, exc, _ in build_plans(jobs, lanes, max_workers=12):
        log(f"[matrix] build of {k[1]} failed: {type(exc).__name__}: {exc}")
    log(f"[matrix] {backend_name}: {len(cases)} cases, plans built in {time.time() - t0:.0f}s")
    for c in cases:
        row = {"backend": backend_name, "case": c.id, **dataclasses.asdict(c)}
        if deadline_s is not None and time.time() - t0 > deadline_s:
            row.update(status="skipped", reason="deadline")
            rows.append(row)
            continue
        be = backends[(c.geometry, c.weights)]
        restore = None
        try:
            bm = c.block_m
            g = be.g
            inp = make_inputs(g, c.num_tokens, seed=1000 + c.seed, **c.routing_kwargs()).to(dev)
            m = c.launch_tokens
            recipe = be.recipe_for(m, mma)
            row["reference_recipe"] = {"name": recipe.name, "mma": recipe.mma, "accumulate": recipe.accumulate}
            sel, ref_inp = None, inp
            if ref_max_tokens is not None and c.num_tokens > ref_max_tokens:
                sel, ref_inp = _subset(inp, ref_max_tokens, c.seed)
            row["ref_tokens"] = ref_inp.num_tokens
            if c.ref_key() not in refs or refs[c.ref_key()][0] != recipe:
                tr = time.time()
                res = moe_forward(ref_inp, be.kernel_weights, recipe, g, keep_stages=True)
                refs[c.ref_key()] = (recipe, res, time.time() - tr)
            _, res, t_ref = refs[c.ref_key()]
            if c.broken:
                restore = _break(be, c)
            row["plan"] = be.plan(m, bm).describe() if m else "no launch (0 tokens)"
            be.poison_intermediates()
            be.stage(inp, m)
            y = be.launch(m, bm)[: c.num_tokens].clone()
            _sync(dev)
            row["plan"] = be.plan(m, bm).describe() if m else row["plan"]  # now known for every backend
            inter = be.intermediates() if c.num_tokens else None
            y_full = y
            if sel is not None:
                y = y[sel]
            row["nan"] = int(torch.isnan(y.float()).sum())
            row["calc_diff"] = calc_diff(y, res.y[0]) if c.num_tokens else 0.0
            row["bitwise_frac"] = float((y.view(torch.int16) == res.y[0].view(torch.int16)).float().mean()) if c.num_tokens else 1.0
            if c.routing == "allmasked":
                rows_masked = torch.tensor(c.routing_kwargs()["fully_masked_tokens"], device=dev)
                row["masked_rows_zero"] = bool((y_full[rows_masked].float() == 0).all())
            if inter is not None:
                row.update({k: v for k, v in compare_l2_inputs(inter, res.ranks[0], ref_inp, g.num_topk).items()})
            row["ref_s"] = round(t_ref, 2)
            loss = getattr(be, "decode_loss", None)
            if loss:  # accepted lossy scales: what the decode loses, against the exact-decode layer
                row["decode_loss"] = loss["summary"]
                # Against the checkpoint's exact values (a backend that rewrites weights keeps them aside).
                y_exact = moe_forward(ref_inp, getattr(be, "checkpoint_weights", be.kernel_weights),
                                      recipe.with_(weight_decode="exact"), g)
                row["calc_diff_vs_exact_decode"] = calc_diff(y, y_exact)
                row["ref_vs_exact_decode"] = calc_diff(res.y[0], y_exact)
            if m and repeats and not c.broken:  # the same staged step again: a kernel must give the same bits
                row.update(_repeat_check(be, inp, m, bm, y_full, repeats, c.num_tokens))
            if m and time_iters and not c.broken and dev.type == "cuda":
                row["launch_us"] = _time_launch(be, m, bm, time_iters)
            passed = row["nan"] == 0 and row["calc_diff"] <= MAX_DIFF and row.get("code_match", 1.0) >= MIN_CODE_MATCH
            if c.routing == "allmasked":
                passed = passed and row["masked_rows_zero"]
            status = ("detected" if not passed else "NOT DETECTED") if c.broken else ("pass" if passed else "FAIL")
            if status == "pass" and row.get("repeats_differing"):
                status = "nondeterministic"  # right against the reference once, different bits on a relaunch
            row["status"] = status
        except Exception as exc:  # noqa: BLE001 - one case must not stop the matrix
            row.update(status="error", error=f"{type(exc).__name__}: {exc}", tb=traceback.format_exc()[-2000:])
        finally:
            if restore is not None:
                restore()
        rows.append(row)
        relaunched = f" relaunches differing {row['repeats_differing']}/{row['repeats']}" if row.get("repeats") else ""
        log(f"[matrix] {c.id:45s} {row.get('status'):12s} diff {row.get('calc_diff', float('nan')):.2e}{relaunched} "
            f"codes {row.get('code_match', float('nan')):.4f} sf {row.get('sf_match', float('nan')):.3f} "
            f"{row.get('launch_us', float('nan')):8.1f} us  {row.get('plan', '')}")
        _write(out_json, rows)
    for be in backends.values():
        be.destroy()
    _write(out_json, rows)
    return rows


def get_geometry_safe(name):
    from ..geometry import get_geometry

    return get_geometry(name)


def _fp8(w):
    from ..layouts.deepgemm_sm90 import to_fp8_block

    return to_fp8_block(w)


def _write(path, rows) -> None:
    """{"meta": {"modules": the kernel packages this process imported, with versions}, "rows": rows}."""
    from ..provenance import imported_kernel_modules

    if path:
        with open(path, "w") as f:
            json.dump({"meta": {"modules": imported_kernel_modules()}, "rows": rows}, f, indent=1, default=str)


def format_table(rows: list[dict]) -> str:
    """Markdown table of matrix rows."""
    head = ("| backend | case | status | calc_diff | L2-input codes identical | L2 scales identical | L2 sf rel | "
            "relaunches differing | reference | launch (us) | plan |\n|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        def f(k, fmt):
            v = r.get(k)
            return fmt.format(v) if isinstance(v, (int, float)) else "-"
        rr = r.get("reference_recipe") or {}
        ref = f"{rr.get('mma')}/{rr.get('accumulate')}" + (f" ({r['ref_tokens']} tok)" if r.get("ref_tokens", r.get("num_tokens")) != r.get("num_tokens") else "") if rr else "-"
        lines.append(f"| {r.get('backend')} | {r.get('case')} | {r.get('status')} | {f('calc_diff', '{:.2e}')} | "
                     f"{f('code_match', '{:.4f}')} | {f('sf_match', '{:.4f}')} | {f('sf_rel_median', '{:.1e}')} | "
                     f"{(str(r['repeats_differing']) + '/' + str(r['repeats'])) if 'repeats' in r else '-'} | {ref} | "
                     f"{f('launch_us', '{:.1f}')} | {r.get('plan', r.get('error', r.get('reason', '')))} |")
    return "\n".join(lines)
