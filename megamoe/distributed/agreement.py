"""What the ranks of one launch must agree on before it starts.

    agree_on_step(group, T)     every rank's token count in one small all-reduce, then the agreed count
                                (FlashInfer: every rank passes the same count, the max) and the DeepGEMM
                                plan hint (mean tokens per rank, rounded up); the all-reduce is timed
    setup_fingerprint(...)      digests of (geometry, recipe, weight shapes, weight bytes, extras)
    check_same_setup(group, fp) every rank raises the same SetupMismatchError if any rank differs,
                                or the same RankInputError if any rank refused its own inputs

Everything that must match across ranks is agreed in one exchange *before the first collective of the
work itself*: geometry (top-k, clamp, routed scaling, ...), recipe (and so the record width on the wire),
scheme, weights (shapes and bytes), capacity, group size. A rank whose own arguments fail their checks
says so in the same exchange, so no rank waits out a timeout in a collective the others never enter,
and none meets a peer that sends rows of another width (gloo "Connection reset", SIGABRT).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from ..geometry import Geometry
from ..recipe import Recipe, get_recipe
from ..validate import memo_per_content
from .comm import _all_gather_single, comm_device


class SetupMismatchError(ValueError):
    """Ranks of one group disagree on geometry, recipe or weights; raised identically on every rank."""


class RankInputError(ValueError):
    """One or more ranks refused their own arguments (bad inputs, say); raised on every rank, naming the
    ranks and their errors, before any collective of the work started."""


LOCAL_CHECKS = "this rank's own checks"


# ------------------------------------------------------------------------------ the agreement rule
def _plan_rules():
    """The real rules from megamoe.layouts.plans when present, else the same rules written here."""
    try:
        from ..layouts.plans import agreed_token_count, deepgemm_plan_hint  # type: ignore[attr-defined]

        return agreed_token_count, deepgemm_plan_hint, "megamoe.layouts.plans"
    except ImportError:
        return _agreed_token_count, _deepgemm_plan_hint, "megamoe.distributed.agreement (fallback)"


def _agreed_token_count(per_rank_counts) -> int:
    """FlashInfer: every rank of a launch passes the same token count, the largest (>= 1)."""
    return max(1, max(int(c) for c in per_rank_counts))


def _deepgemm_plan_hint(per_rank_counts) -> int:
    """DeepGEMM SM90: the mean tokens per EP rank of the step, rounded up (>= 1)."""
    counts = [int(c) for c in per_rank_counts]
    return max(1, -(-sum(counts) // len(counts)))


@dataclass(frozen=True)
class StepAgreement:
    """One step's agreement: counts[r] tokens on rank r; every rank pads to ``agreed`` and passes
    ``hint`` as the plan hint. ``seconds`` is this rank's wall time of the all-reduce."""

    counts: tuple[int, ...]
    agreed: int
    hint: int
    seconds: float
    rule: str = ""

    @property
    def padding_rows(self) -> int:
        """Rows added over all ranks by padding to ``agreed``."""
        return sum(self.agreed - c for c in self.counts)


def agree_on_step(group, num_tokens: int, local_error: str | None = None) -> StepAgreement:
    """One all-reduce of an int64 [2R] vector (rank r writes its count at r, and 1 at R + r when its own
    checks failed: ``local_error``, or a ``num_tokens`` that is not a non-negative int), then the plan
    rules. A failed rank is known to every rank after that one collective: all raise RankInputError."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if local_error is None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0):
        local_error = f"ValueError: num_tokens must be a non-negative int, got {num_tokens!r}"
    vec = torch.zeros(2 * world, dtype=torch.int64, device=comm_device(group))
    vec[rank] = num_tokens if local_error is None else 0
    vec[world + rank] = int(local_error is not None)
    if vec.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=group)
    got = vec.cpu()  # .cpu() waits for the collective on every backend
    seconds = time.perf_counter() - t0
    failed = [r for r in range(world) if int(got[world + r])]
    if failed:
        mine = f"; this rank (rank {rank}): {local_error}" if local_error is not None else ""
        raise RankInputError(f"ranks {failed} of {world} refused their own step before the launch; every rank "
                             f"stops{mine}")
    counts = tuple(int(c) for c in got[:world])
    agreed_fn, hint_fn, rule = _plan_rules()
    return StepAgreement(counts, int(agreed_fn(list(counts))), int(hint_fn(list(counts))), seconds, rule)


# ------------------------------------------------------------------------------ same setup everywhere
def _weights_digest(weights, chunk_bytes: int = 1 << 26) -> str:
    """sha256 over every weight tensor's dtype, shape and bytes; each tensor hashed once per content
    (``validate.memo_per_content``: version and checksum, so a write made behind torch's version
    counter is seen), and a step does not re-hash gigabytes of unchanged weights."""
    h = hashlib.sha256()
    for f in fields(weights):
        t = getattr(weights, f.name)
        if t is None:
            h.update(f"{f.name}:None;".encode())
            continue
        h.update(f"{f.name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(memo_per_content(t, "sha256", lambda t=t: _tensor_digest(t, chunk_bytes)))
    return h.hexdigest()


def _tensor_digest(t: torch.Tensor, chunk_bytes: int) -> bytes:
    h = hashlib.sha256()
    flat = t.detach().contiguous().view(-1).view(torch.uint8)
    for i in range(0, flat.numel(), chunk_bytes):
        h.update(flat[i : i + chunk_bytes].cpu().numpy().tobytes())
    return h.digest()


def setup_fingerprint(g: Geometry, recipe: "Recipe | str | None", weights, *, weight_bytes: bool = True,
                      **extra) -> dict[str, tuple[str, str]]:
    """component -> (human description, sha256 hex digest). Components: geometry, recipe (None: the
    backend's own), weight shapes, weight bytes (unless ``weight_bytes=False``: ranks holding only their
    own experts), and one per keyword in ``extra`` (e.g. num_ranks, scheme, capacity)."""
    recipe = get_recipe(recipe) if recipe is not None else None
    shapes = {f.name: (None if getattr(weights, f.name) is None else tuple(getattr(weights, f.name).shape))
              for f in fields(weights)}
    desc = {
        "geometry": repr(g),
        "recipe": repr(recipe),
        "weight shapes": f"{type(weights).__name__} {shapes}",
    }
    desc.update({k: repr(v) for k, v in sorted(extra.items())})
    fp = {k: (v, hashlib.sha256(v.encode()).hexdigest()) for k, v in desc.items()}
    if weight_bytes:
        wd = _weights_digest(weights)
        fp["weight bytes"] = (f"sha256 {wd[:16]}", wd)
    return fp


def local_check(fn, *args, **kwargs) -> str | None:
    """Run this rank's own check ``fn(*args, **kwargs)``; None when it passes, else its error as text
    (what ``check_same_setup`` tells the other ranks)."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any refusal is told to the other ranks, then raised on all
        return f"{type(exc).__name__}: {exc}"
    return None


def check_same_setup(group, fingerprint: dict[str, tuple[str, str]], local_error: str | None = None) -> None:
    """All-gather the digests (and whether this rank's own checks passed, ``local_error``); if any rank's
    checks failed, every rank raises the same RankInputError naming those ranks and their errors; else if
    any component differs, every rank raises the same SetupMismatchError naming the component and each
    rank's value. Two small all-gathers when everything agrees; the gather is safe whatever the ranks
    hold (lengths first, then bytes of equal length, objects only on a mismatch)."""
    fingerprint = dict(fingerprint)
    text = "ok" if local_error is None else local_error
    fingerprint[LOCAL_CHECKS] = (text, hashlib.sha256(text.encode()).hexdigest())
    names = list(fingerprint)
    world = dist.get_world_size(group)
    dev = comm_device(group)
    # The component names are part of the digest, so ranks with different components also differ.
    names_digest = hashlib.sha256("|".join(names).encode()).digest()
    mine = torch.tensor(list(names_digest) + [b for n in names for b in bytes.fromhex(fingerprint[n][1])],
                        dtype=torch.uint8, device=dev)
    lens = torch.zeros(world, dtype=torch.int64, device=dev)
    _all_gather_single(lens, torch.tensor([mine.numel()], dtype=torch.int64, device=dev), group=group)
    if len(set(lens.tolist())) == 1:
        allfp = torch.empty(world * mine.numel(), dtype=torch.uint8, device=dev)
        _all_gather_single(allfp, mine, group=group)
        rows = allfp.view(world, -1).cpu()
        if bool((rows == rows[0]).all()):
            if local_error is not None:  # every rank refused its inputs, in the same words
                raise RankInputError(f"every one of the {world} ranks refused its own arguments: {local_error}")
            return
    # Slow path, mismatch only: gather the descriptions to say what differs.
    descs: list = [None] * world
    dist.all_gather_object(descs, {n: fingerprint[n] for n in names}, group=group)
    failed = {r: d.get(LOCAL_CHECKS, ("ok", ""))[0] for r, d in enumerate(descs)}
    failed = {r: msg for r, msg in failed.items() if msg != "ok"}
    if failed:
        raise RankInputError(f"{len(failed)} of the {world} ranks refused their own arguments before any "
                             "collective; every rank stops:\n" + "\n".join(f"  rank {r}: {m}" for r, m in failed.items()))
    lines = []
    for comp in dict.fromkeys(n for d in descs for n in d):
        vals = [d.get(comp, ("<missing>", ""))[1] for d in descs]
        if len(set(vals)) > 1:
            groups: dict[str, list[int]] = {}
            for r, d in enumerate(descs):
                groups.setdefault(d.get(comp, ("<missing>", ""))[0], []).append(r)
            lines.append(f"  {comp}: " + "; ".join(f"ranks {rs}: {v}" for v, rs in groups.items()))
    raise SetupMismatchError(
        f"the {world} ranks of the group disagree on their setup (every rank must hold the same "
        f"geometry, recipe, scheme and weights):\n" + "\n".join(lines)
    )
