"""``megamoe check --ranks N`` and ``megamoe bench --ranks N``: spawn N gloo ranks, run the distributed
reference, compare with the single-process reference bit for bit, time the agreement all-reduce.

    check_ranks(num_ranks, preset, tokens_per_rank, seed) -> DistCheckReport
    bench_ranks(num_ranks, preset, tokens_per_rank, seed, iters) -> DistBenchReport
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from ..geometry import Geometry, get_geometry
from ..inputs import MoEInputs, make_inputs
from ..recipe import get_recipe
from ..reference.pipeline import moe_forward, moe_forward_ep
from ..testing import first_mismatch, weights_for_recipe
from ..weights import MXFP4Weights, random_mxfp4_weights
from .agreement import agree_on_step, check_same_setup, setup_fingerprint
from .fused import FusedEPLauncher, ReferenceEPBackend, check_ep_ranks, make_fused_backend
from .launch import spawn
from .reference import SCHEMES, moe_forward_dist

DEFAULT_RAGGED = (0, 1, 37, 256)
CHECK_PATHS = (*SCHEMES, "launcher")  # the two reference schemes and the fused launcher's path


def default_tokens(num_ranks: int) -> list[int]:
    """Ragged counts with an empty rank: 0, 1, 37, 256, then 5, 130, ... for more ranks."""
    extra = [5, 130, 64, 19]
    return [(list(DEFAULT_RAGGED) + extra * 8)[r] for r in range(num_ranks)]


def fast_random_weights(g: Geometry, *, seed: int) -> MXFP4Weights:
    """Random MXFP4 experts straight from random bytes: every code pair uniform, scale bytes in
    122..124 (2**-5 .. 2**-3, inside FlashInfer's legal range). Milliseconds instead of the seconds
    ``random_mxfp4_weights`` spends quantizing Gaussians; enough for bitwise rank checks."""
    gen = torch.Generator().manual_seed(seed)
    e, h, i = g.num_experts, g.hidden, g.intermediate

    def codes(*shape):
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.int64).to(torch.uint8)

    def scales(*shape):
        return torch.randint(122, 125, shape, generator=gen, dtype=torch.int64).to(torch.uint8)

    return MXFP4Weights(codes(e, 2 * i, h // 2), scales(e, 2 * i, h // 32), codes(e, h, i // 2), scales(e, h, i // 32))


def rank_inputs(g: Geometry, tokens_per_rank: list[int], seed: int) -> list[MoEInputs]:
    """The global step: rank r's inputs from seed (seed, r), some slots masked, one token fully masked."""
    out = []
    for r, t in enumerate(tokens_per_rank):
        fm = (t // 2,) if t >= 3 else ()
        out.append(make_inputs(g, t, seed=seed * 1009 + r, mask_prob=0.1, fully_masked_tokens=fm))
    return out


@dataclass
class RankResult:
    rank: int
    num_tokens: int
    ys: dict[str, torch.Tensor]  # scheme -> y [T_r, H]
    agreement_s: list[float]
    seconds: dict[str, float]
    backend_calls: list[dict] = field(default_factory=list)  # what the launcher handed its backend


def _check_worker(rank, world, g, recipe, weights, inputs, schemes, block_m, agree_iters, fail_rank, bad_rank):
    import torch.distributed as dist

    if rank == fail_rank:
        raise RuntimeError(f"injected failure on rank {rank}")
    geom = g.with_(clamp=g.clamp * 2) if rank == bad_rank else g
    check_same_setup(None, setup_fingerprint(geom, recipe, weights, block_m=block_m, num_ranks=world))
    inp = inputs[rank]
    agree = []
    for _ in range(agree_iters):
        dist.barrier()  # time the all-reduce, not the ranks' skew on arrival
        agree.append(agree_on_step(None, inp.num_tokens))
    ys, secs, calls = {}, {}, []
    for s in schemes:
        dist.barrier()
        t0 = time.perf_counter()
        if s == "launcher":  # the fused launcher's path, with the reference as its backend
            be = ReferenceEPBackend(geom, recipe, scheme="all_to_all", block_m=block_m)
            ys[s] = FusedEPLauncher(be, weights, geom, require_hopper=False).step(inp)[0]
            calls = be.calls
        else:
            ys[s] = moe_forward_dist(inp, weights, recipe, geom, scheme=s, block_m=block_m)
        secs[s] = time.perf_counter() - t0
    res = RankResult(rank, inp.num_tokens, ys, [a.seconds for a in agree], secs, calls)
    return res, agree[-1] if agree else None


@dataclass
class DistCheckReport:
    """Per rank and scheme: '' when y is bit-identical to both single-process references, else the
    first mismatch. ``agreement_us``: median all-reduce time of the agreement, per rank."""

    num_ranks: int
    preset: str
    recipe: str
    tokens_per_rank: list[int]
    mismatches: dict[tuple[int, str, str], str] = field(default_factory=dict)  # (rank, scheme, vs) -> msg
    agreement_us: list[float] = field(default_factory=list)
    agreed: int = 0
    hint: int = 0
    rule: str = ""
    seconds: float = 0.0
    schemes: tuple[str, ...] = SCHEMES
    backend_calls: dict[int, list[dict]] = field(default_factory=dict)  # rank -> launcher's backend calls
    ys: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict, repr=False)  # (rank, path) -> y [T_r, H]

    @property
    def ok(self) -> bool:
        return not any(self.mismatches.values())

    def summary(self) -> str:
        lines = [f"distributed reference, {self.num_ranks} gloo ranks, preset {self.preset!r}, recipe "
                 f"{self.recipe!r}, tokens per rank {self.tokens_per_rank}: "
                 + ("bit-identical to the single-process reference" if self.ok else "MISMATCH")]
        for (r, s, vs), msg in sorted(self.mismatches.items()):
            lines.append(f"  rank {r} {s:<24} vs {vs:<16} {'ok' if not msg else msg}")
        lines.append(f"  agreement all-reduce: median {statistics.median(self.agreement_us):.0f} us "
                     f"(per rank {[round(u) for u in self.agreement_us]}); agreed {self.agreed} tokens, "
                     f"plan hint {self.hint} ({self.rule})")
        lines.append(f"  wall time {self.seconds:.1f} s")
        return "\n".join(lines)


def check_ranks(
    num_ranks: int,
    preset: str = "tiny",
    tokens_per_rank: "list[int] | None" = None,
    seed: int = 0,
    *,
    recipe: str = "flashinfer-mxfp4",
    schemes: tuple[str, ...] = CHECK_PATHS,
    block_m: int = 1,
    agree_iters: int = 20,
    timeout_s: float = 120.0,
    fast_weights: bool = True,
    _fail_rank: int = -1,
    _bad_rank: int = -1,
) -> DistCheckReport:
    """Spawn num_ranks gloo ranks (127.0.0.1), run the distributed reference on each rank's own
    tokens (each scheme, and the FusedEPLauncher path over the reference backend: agreement, padding
    to the agreed count, launch), and compare every rank's y bitwise with moe_forward_ep (all ranks
    in this process) and with moe_forward on the concatenated step. Raises RankError if a rank fails
    (SetupMismatchError text on every rank if they disagree on geometry / recipe / weights)."""
    t0 = time.perf_counter()
    g = get_geometry(preset)
    recipe_obj = get_recipe(recipe)
    tokens = list(tokens_per_rank) if tokens_per_rank is not None else default_tokens(num_ranks)
    if len(tokens) != num_ranks:
        raise ValueError(f"tokens_per_rank must have one count per rank ({num_ranks}), got {tokens}")
    g.experts_per_rank(num_ranks)
    weights = fast_random_weights(g, seed=seed) if fast_weights else random_mxfp4_weights(g, seed=seed)
    weights = weights_for_recipe(weights, recipe_obj)  # what the recipe's kernel is handed, as the 1-rank check does
    inputs = rank_inputs(g, tokens, seed)
    results = spawn(_check_worker, num_ranks, timeout_s=timeout_s,
                    args=(g, recipe_obj, weights, inputs, tuple(schemes), block_m, agree_iters, _fail_rank, _bad_rank))
    ep = moe_forward_ep(inputs, weights, recipe_obj, g, block_m=block_m).y
    cat = MoEInputs(*(torch.cat([getattr(i, n) for i in inputs]) for n in ("x", "topk_idx", "topk_weights")))
    one = moe_forward(cat, weights, recipe_obj, g, block_m=block_m)
    offs = [0]
    for t in tokens:
        offs.append(offs[-1] + t)
    rep = DistCheckReport(num_ranks, g.name, recipe_obj.name, tokens, schemes=tuple(schemes))
    for res, agree in results:
        r = res.rank
        for s, y in res.ys.items():
            rep.ys[(r, s)] = y
            rep.mismatches[(r, s, "moe_forward_ep")] = first_mismatch(y, ep[r])
            rep.mismatches[(r, s, "moe_forward")] = first_mismatch(y, one[offs[r] : offs[r + 1]])
        rep.backend_calls[r] = res.backend_calls
        rep.agreement_us.append(statistics.median(res.agreement_s) * 1e6 if res.agreement_s else float("nan"))
        if agree is not None:
            rep.agreed, rep.hint, rep.rule = agree.agreed, agree.hint, agree.rule
    rep.seconds = time.perf_counter() - t0
    return rep


@dataclass
class DistBenchReport:
    num_ranks: int
    preset: str
    tokens_per_rank: list[int]
    step_ms: dict[str, float]  # scheme -> median over iters of the slowest rank's step
    agreement_us: float  # median all-reduce of the agreement over ranks and iters

    def summary(self) -> str:
        steps = ", ".join(f"{s} {ms:.2f} ms" for s, ms in self.step_ms.items())
        return (f"distributed reference, {self.num_ranks} gloo ranks, preset {self.preset!r}, tokens "
                f"{self.tokens_per_rank}: step (slowest rank, median) {steps}; agreement all-reduce "
                f"{self.agreement_us:.0f} us")


def _bench_worker(rank, world, g, recipe, weights, inputs, schemes, iters):
    import torch.distributed as dist

    inp = inputs[rank]
    agree = []
    for _ in range(max(iters, 10)):
        dist.barrier()
        agree.append(agree_on_step(None, inp.num_tokens).seconds)
    times = {s: [] for s in schemes}
    for s in schemes:
        moe_forward_dist(inp, weights, recipe, g, scheme=s)  # warm-up
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            moe_forward_dist(inp, weights, recipe, g, scheme=s)
            times[s].append(time.perf_counter() - t0)
    return agree, times


def bench_ranks(num_ranks: int, preset: str = "tiny", tokens_per_rank: "list[int] | None" = None, seed: int = 0,
                *, recipe: str = "flashinfer-mxfp4", schemes: tuple[str, ...] = SCHEMES, iters: int = 3,
                timeout_s: float = 300.0) -> DistBenchReport:
    """Wall time of the distributed reference per scheme (slowest rank per iteration, median) and of
    the agreement all-reduce, over num_ranks spawned gloo ranks."""
    g = get_geometry(preset)
    g.experts_per_rank(num_ranks)  # refused here, before any rank starts
    tokens = list(tokens_per_rank) if tokens_per_rank is not None else default_tokens(num_ranks)
    weights = fast_random_weights(g, seed=seed)
    inputs = rank_inputs(g, tokens, seed)
    res = spawn(_bench_worker, num_ranks, timeout_s=timeout_s,
                args=(g, get_recipe(recipe), weights, inputs, tuple(schemes), iters))
    step_ms = {s: statistics.median(max(r[1][s][i] for r in res) for i in range(iters)) * 1e3 for s in schemes}
    agree = statistics.median(a for r in res for a in r[0]) * 1e6
    return DistBenchReport(num_ranks, g.name, tokens, step_ms, agree)


# ------------------------------------------------------------------------------ the GPU check
def _fused_worker(rank, world, name, g, weights, inputs, capacity):
    import torch.distributed as dist

    dev = torch.device("cuda", torch.cuda.current_device())
    be = make_fused_backend(name, g, group=dist.group.WORLD, capacity=capacity)
    launcher = FusedEPLauncher(be, weights, g, max_tokens_per_rank=capacity)
    y, a = launcher.step(inputs[rank].to(dev))
    torch.cuda.synchronize()
    return y.cpu(), a


def check_fused_ranks(num_ranks: int, backend: str = "flashinfer-mxfp4", preset: str = "small",
                      tokens_per_rank: "list[int] | None" = None, seed: int = 0, *, timeout_s: float = 300.0):
    """Spawn num_ranks NCCL ranks (one GPU each), run the fused backend through FusedEPLauncher on
    every rank's own ragged tokens, and compare each rank's y with moe_forward_ep under the backend's
    recipe. Returns [(rank, T_r, calc_diff, StepAgreement)]. num_ranks=1 is the same path."""
    from ..fused.registry import get_backend_class
    from ..testing import calc_diff, weights_for_recipe

    check_ep_ranks(num_ranks)
    g = get_geometry(preset)
    cls = get_backend_class(backend)
    recipe = cls.recipe
    tokens = list(tokens_per_rank) if tokens_per_rank is not None else default_tokens(num_ranks)
    weights = cls.synthetic_weights(weights_for_recipe(fast_random_weights(g, seed=seed), recipe))
    inputs = rank_inputs(g, tokens, seed)
    capacity = max(1, max(tokens))
    out = spawn(_fused_worker, num_ranks, backend="nccl", timeout_s=timeout_s,
                args=(backend, g, weights, inputs, capacity))
    ref = moe_forward_ep(inputs, weights, recipe, g).y
    return [(r, tokens[r], calc_diff(y.float(), ref[r].float()), a) for r, (y, a) in enumerate(out)]
