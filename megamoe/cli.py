"""The ``megamoe`` command (also ``python -m megamoe``).

    megamoe check     every stage of every kernel recipe against exact, sanity checks, fused backends' matrices
    megamoe bench     every backend at every token count against the card's measured ceilings
    megamoe --version

Both commands share their arguments' names and meanings (``megamoe.args``): --preset, --tokens (per rank, a
list), --backends, --ref-max-tokens, --ranks, --seed, --out DIR, --device. Exit status: 0 when everything that
ran passed, 1 when a check failed or the run stopped on an error (one line: the error; MEGAMOE_TRACEBACK=1 for
its traceback), 2 on a bad argument (refused before any work), 130 on Ctrl-C.
"""

from __future__ import annotations

import sys

from .args import Parser, interrupted

DESCRIPTION = """\
megamoe: a readable reference of the fused SM90 Mega MoE layer beside its kernels.

  megamoe check    every kernel recipe against exact, stage by stage, and the
                   differential matrix of each fused backend named
  megamoe bench    every backend at every token count against the card's ceilings

Both take --preset, --tokens (per rank), --backends, --ref-max-tokens, --ranks,
--seed, --out DIR and --device. Exit status: 0 passed, 1 a check failed, 2 a bad
argument (refused before any work), 130 interrupted."""


def build_parser() -> Parser:
    from . import __version__
    from .bench import cli as bench_cli
    from .check import cli as check_cli

    p = Parser(prog="megamoe", description=DESCRIPTION)
    p.add_argument("--version", action="version", version=f"megamoe {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=Parser, metavar="{check,bench}")
    c = sub.add_parser("check", help="every stage of every recipe against exact, with sanity checks (CPU is fine)",
                       description=check_cli.DESCRIPTION, usage="megamoe check [options]")
    check_cli.add_arguments(c)
    c.set_defaults(run=lambda a, argv: check_cli.run(c, a, _explicit(argv)), parser=c)
    b = sub.add_parser("bench", help="time every backend at every token count against measured ceilings",
                       description=bench_cli.DESCRIPTION, usage="megamoe bench [options]")
    bench_cli.add_arguments(b)
    b.set_defaults(run=lambda a, argv: bench_cli.run(b, a), parser=b)
    return p


def _explicit(argv: list[str]) -> set[str]:
    """The flags given on the command line (as opposed to defaults), e.g. {"--preset", "--tokens"}."""
    return {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}


def main(argv: "list[str] | None" = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        p = build_parser()
        try:
            a, extra = p.parse_known_args(argv)
            if extra:  # said by the subcommand's parser: its usage, and the close match among its flags
                getattr(a, "parser", p).error(f"unrecognized arguments: {' '.join(extra)}")
        except SystemExit as exc:  # --help, --version (0) or a bad argument (2)
            return int(exc.code or 0)
        if not getattr(a, "run", None):
            p.print_help()
            return 2
        try:
            return int(a.run(a, argv) or 0)
        except SystemExit as exc:  # a bad argument found by validation, before any work
            return int(exc.code or 0)
        except Exception as exc:  # noqa: BLE001 - anything else: one line and exit 1, never a traceback
            return failed(a.command, exc)
    except KeyboardInterrupt:
        return interrupted()


def failed(command: str, exc: BaseException) -> int:
    """An error after the arguments were accepted: 'megamoe <command>: error: <Type>: <first line>' on stderr and
    exit 1. MEGAMOE_TRACEBACK=1 prints the traceback too (for a bug report)."""
    import os
    import traceback

    if os.environ.get("MEGAMOE_TRACEBACK"):
        traceback.print_exc()
    first = (str(exc).strip().splitlines() or [""])[0]
    print(f"megamoe {command}: error: {type(exc).__name__}: {first}"
          + ("" if os.environ.get("MEGAMOE_TRACEBACK") else " (MEGAMOE_TRACEBACK=1 shows where)"), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
