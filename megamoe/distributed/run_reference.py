"""The distributed reference under ``torchrun``: each worker is one EP rank.

    torchrun --nproc-per-node 4 --master-addr 127.0.0.1 --master-port 29511 \\
        -m megamoe.distributed.run_reference --preset tiny --tokens 0,1,37,256 --seed 0

Every rank builds the same weights and the global step from the seed, runs ``moe_forward_dist`` on
its own tokens with each scheme, and checks its y bit for bit against ``moe_forward_ep`` (all ranks
in one process) and ``moe_forward`` on the concatenated step. Exit status 0 only when every rank
matches. ``--fail-rank r`` raises on rank r, ``--bad-geometry-rank r`` gives rank r another geometry
(both to show that every rank stops with a clear error instead of hanging).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch



def _say(line: str) -> None:
    """One write per line: ranks share the launcher's pipe, and print() writes the text and the newline
    separately, so two ranks' lines could interleave into one (seen in CI: 15 of 16 lines counted)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _parse(argv):
    from .reference import SCHEMES

    p = argparse.ArgumentParser(prog="python -m megamoe.distributed.run_reference", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--tokens", default=None, help="comma-separated token count per rank (default: 0,1,37,256,...)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recipe", default="flashinfer-mxfp4")
    p.add_argument("--scheme", choices=(*SCHEMES, "both"), default="both")
    p.add_argument("--block-m", type=int, default=1)
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: nccl with GPUs, else gloo")
    p.add_argument("--timeout", type=float, default=60.0, help="process-group timeout in seconds")
    p.add_argument("--fail-rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--bad-geometry-rank", type=int, default=-1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _main(rank: int, world: int, args) -> bool:
    from ..geometry import get_geometry
    from ..reference.pipeline import moe_forward, moe_forward_ep
    from ..inputs import MoEInputs
    from ..testing import first_mismatch
    from .agreement import agree_on_step, check_same_setup, setup_fingerprint
    from .check import default_tokens, fast_random_weights, rank_inputs
    from .reference import SCHEMES, moe_forward_dist

    g = get_geometry(args.preset)
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else default_tokens(world)
    if len(tokens) != world:
        raise ValueError(f"--tokens must give one count per rank ({world}), got {tokens}")
    if rank == args.fail_rank:
        raise RuntimeError(f"injected failure on rank {rank} (--fail-rank)")
    if rank == args.bad_geometry_rank:
        g = g.with_(hidden=g.hidden * 2)
    weights = fast_random_weights(g, seed=args.seed)
    check_same_setup(None, setup_fingerprint(g, args.recipe, weights, block_m=args.block_m, num_ranks=world))
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
    inputs = rank_inputs(g, tokens, args.seed)
    torch.distributed.barrier()  # time the all-reduce, not the ranks' skew on arrival
    agreement = agree_on_step(None, tokens[rank])
    schemes = SCHEMES if args.scheme == "both" else (args.scheme,)
    ys = {}
    for s in schemes:
        t0 = time.perf_counter()
        ys[s] = (moe_forward_dist(inputs[rank].to(dev), weights.to(dev), args.recipe, g, scheme=s, block_m=args.block_m).cpu(),
                 time.perf_counter() - t0)
    ep = moe_forward_ep(inputs, weights, args.recipe, g, block_m=args.block_m).y[rank]
    cat = MoEInputs(*(torch.cat([getattr(i, n) for i in inputs]) for n in ("x", "topk_idx", "topk_weights")))
    lo = sum(tokens[:rank])
    one = moe_forward(cat, weights, args.recipe, g, block_m=args.block_m)[lo : lo + tokens[rank]]
    ok = True
    for s, (y, sec) in ys.items():
        for vs, ref in (("moe_forward_ep", ep), ("moe_forward", one)):
            msg = first_mismatch(y, ref)
            ok &= not msg
            _say(f"rank {rank}/{world} T={tokens[rank]:<4} {s:<24} vs {vs:<15} "
                 f"{'bit-identical' if not msg else 'MISMATCH ' + msg} ({sec * 1e3:.0f} ms)")
    _say(f"rank {rank}/{world} agreement: counts {list(agreement.counts)} -> agreed {agreement.agreed}, "
         f"hint {agreement.hint}; all-reduce {agreement.seconds * 1e6:.0f} us")
    if not ok:
        raise AssertionError(f"rank {rank}: the distributed reference differs from the single-process reference")
    return ok


def main(argv=None) -> int:
    from .launch import guarded, init_from_env

    args = _parse(sys.argv[1:] if argv is None else argv)
    rank, world = init_from_env(args.backend, timeout_s=args.timeout)
    try:
        guarded(_main, rank, world, args)
    except BaseException:
        return 1
    finally:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
