"""What the ranks of one launch must agree on before it starts.

    agree_on_step(group, T)     every rank's token count in one small all-reduce, then the agreed count
                                (FlashInfer: every rank passes the same count, the max) and the DeepGEMM
                                plan hint (mean tokens per rank, rounded up); the all-reduce is timed
    setup_fingerprint(...)      digests of (geometry, recipe, weight shapes, weight bytes, extras)
    check_same_setup(group, fp) every rank raises the same SetupMismatchError if any rank differs
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from ..geometry import Geometry
from ..recipe import Recipe, get_recipe
from .comm import _all_gather_single, comm_device


class SetupMismatchError(ValueError):
    """Ranks of one group disagree on geometry, recipe or weights; raised identically on every rank."""


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


def agree_on_step(group, num_tokens: int) -> StepAgreement:
    """One all-reduce of an int64 [R] vector (rank r writes its count at r), then the plan rules."""
    if not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    vec = torch.zeros(world, dtype=torch.int64, device=comm_device(group))
    vec[rank] = num_tokens
    if vec.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=group)
    counts = tuple(int(c) for c in vec.cpu())  # .cpu() waits for the collective on every backend
    seconds = time.perf_counter() - t0
    agreed_fn, hint_fn, rule = _plan_rules()
    return StepAgreement(counts, int(agreed_fn(list(counts))), int(hint_fn(list(counts))), seconds, rule)


# ------------------------------------------------------------------------------ same setup everywhere
def _weights_digest(weights, chunk_bytes: int = 1 << 26) -> str:
    h = hashlib.sha256()
    for f in fields(weights):
        t = getattr(weights, f.name)
        if t is None:
            h.update(f"{f.name}:None;".encode())
            continue
        h.update(f"{f.name}:{t.dtype}:{tuple(t.shape)};".encode())
        flat = t.detach().contiguous().view(-1).view(torch.uint8)
        for i in range(0, flat.numel(), chunk_bytes):
            h.update(flat[i : i + chunk_bytes].cpu().numpy().tobytes())
    return h.hexdigest()


def setup_fingerprint(g: Geometry, recipe: "Recipe | str | None", weights, **extra) -> dict[str, tuple[str, str]]:
    """component -> (human description, sha256 hex digest). Components: geometry, recipe (None: the
    backend's own), weight shapes, weight bytes, and one per keyword in ``extra`` (e.g. num_ranks)."""
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
    wd = _weights_digest(weights)
    fp["weight bytes"] = (f"sha256 {wd[:16]}", wd)
    return fp


def check_same_setup(group, fingerprint: dict[str, tuple[str, str]]) -> None:
    """All-gather the digests; if any component differs, every rank raises the same
    SetupMismatchError naming the component and each rank's value."""
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
            return
    # Slow path, mismatch only: gather the descriptions to say what differs.
    descs: list = [None] * world
    dist.all_gather_object(descs, {n: fingerprint[n] for n in names}, group=group)
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
        f"geometry, recipe and weights):\n" + "\n".join(lines)
    )

