"""The ``megamoe`` console script.

    megamoe check                                   # small preset, 64 tokens, every recipe vs exact, CPU
    megamoe check --preset tiny --tokens 9 --ranks 4 --block-m 64 --json out.json
    megamoe check --backend flashinfer-mxfp4        # plus a fused backend's differential matrix (SM90)
    megamoe check --ranks 4 --dist                  # real gloo ranks (megamoe.distributed) instead of simulated
    megamoe bench ...                               # megamoe.bench.cli (single GPU sweep)
    megamoe bench --ranks 4 --preset tiny           # real gloo EP ranks, distributed reference step

Exit status: 0 when every sanity check passed, 1 when one failed, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys

from .geometry import PRESETS
from .recipe import RECIPES


def _add_check_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="small", choices=sorted(PRESETS), help="geometry preset (default: small)")
    p.add_argument("--tokens", type=int, default=64, help="tokens in the step, split raggedly over the ranks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-m", type=int, default=8, help="BLOCK_M the pools are padded to")
    p.add_argument("--ranks", type=int, default=1, help="simulated expert-parallel ranks (must divide E)")
    p.add_argument("--recipes", nargs="+", default=None, choices=[r for r in RECIPES if r != "exact"],
                   help="kernel recipes to compare with exact (default: all)")
    p.add_argument("--json", metavar="PATH", default=None, help="write the report as JSON")
    p.add_argument("--backend", metavar="NAME", default=None,
                   help="also run this fused backend's differential matrix (megamoe.fused.registry)")
    p.add_argument("--mma", default="sm90-fp8-tc", choices=["exact-block", "sm90-fp8-tc"],
                   help="--backend: the reference's tensor-core model (default: the H200's emulated accumulation)")
    p.add_argument("--ref-max-tokens", type=int, default=512,
                   help="--backend: above this many tokens the reference runs on a random token subset")
    p.add_argument("--quick", action="store_true", help="--backend: the shorter matrix")
    p.add_argument("--matrix-deadline", type=float, default=None, metavar="S",
                   help="--backend: cases not started within S seconds are reported as skipped")
    p.add_argument("--matrix-json", metavar="PATH", default=None, help="--backend: write the matrix rows as JSON")
    p.add_argument("--dist", action="store_true",
                   help="spawn --ranks gloo processes (megamoe.distributed) and compare bitwise, instead of simulating")


def _check(a: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 160)
    if a.dist:
        try:
            from .distributed.check import check_ranks
        except ImportError as exc:
            console.print(f"[red]--dist needs megamoe.distributed: {exc}[/red]")
            return 2
        from .distributed.agreement import SetupMismatchError
        from .distributed.launch import RankError

        try:
            rep = check_ranks(a.ranks, a.preset, None, a.seed, block_m=a.block_m)
        except (RankError, SetupMismatchError) as exc:
            console.print(f"[red]megamoe check --dist: {exc}[/red]")
            return 1
        except (TypeError, ValueError) as exc:  # bad arguments, refused before any rank started
            console.print(f"[red]megamoe check --dist: {exc}[/red]")
            return 2
        console.print(rep.summary())
        return 0 if rep.ok else 1

    from .check import backend_availability, render, run_check, run_backend

    try:
        report = run_check(preset=a.preset, tokens=a.tokens, seed=a.seed, block_m=a.block_m, ranks=a.ranks,
                           recipes=a.recipes)
    except ValueError as exc:
        console.print(f"[red]megamoe check: {exc}[/red]")
        return 2
    report.backends = backend_availability()
    if a.backend:
        run_backend(report, a.backend, a.matrix_json, mma=a.mma, ref_max_tokens=a.ref_max_tokens, quick=a.quick,
                    deadline_s=a.matrix_deadline)
    render(report, console)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report.to_dict(), f, indent=1, default=str)
        console.print(f"report written to {a.json}")
    return 0 if report.ok else 1


def _bench(a: argparse.Namespace) -> int:
    if a.ranks < 1:
        print(f"megamoe bench: --ranks must be >= 1, got {a.ranks}", file=sys.stderr)
        return 2
    if a.ranks > 1:
        from .distributed.check import bench_ranks
        from .distributed.launch import RankError

        try:
            rep = bench_ranks(a.ranks, getattr(a, "preset", None) or "tiny", None, getattr(a, "seed", 0) or 0)
        except (TypeError, ValueError) as exc:  # bad arguments, refused before any rank started
            print(f"megamoe bench --ranks: {exc}", file=sys.stderr)
            return 2
        except RankError as exc:
            print(f"megamoe bench --ranks: {exc}", file=sys.stderr)
            return 1
        print(rep.summary())
        return 0
    from .bench import cli as bench_cli

    return int(bench_cli.main(a) or 0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megamoe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command")
    c = sub.add_parser("check", help="every stage of every recipe vs exact, with sanity checks (CPU is fine)")
    _add_check_arguments(c)
    c.set_defaults(func=_check)
    try:
        from .bench import cli as bench_cli
    except ImportError:
        bench_cli = None
    if bench_cli is not None:
        b = sub.add_parser("bench", help="timing sweep of the fused backends and the reference")
        bench_cli.add_arguments(b)
        b.add_argument("--ranks", type=int, default=1,
                       help="> 1: spawn this many gloo EP ranks and time the distributed reference step "
                            "(megamoe.distributed.bench_ranks) instead of the single-GPU sweep")
        b.set_defaults(func=_bench)
    return p


def main(argv: "list[str] | None" = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if not getattr(a, "func", None):
        p.print_help()
        return 2
    return int(a.func(a) or 0)


if __name__ == "__main__":
    sys.exit(main())
