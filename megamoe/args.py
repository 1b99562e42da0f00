"""The arguments ``megamoe check`` and ``megamoe bench`` share, with one name and one meaning in both, and their
validation: every bad argument is refused before any work, with exit status 2 and a message that names the
argument, what it accepts and the closest valid spelling.

    --preset NAME          geometry preset
    --tokens T [T ...]     tokens PER RANK, a list: one step per value
    --backends NAME [...]  fused backends by registry name (bench: and "reference"); "all": every one that runs here
                           (the teaching kernel megamoe-decode only by name)
    --ref-max-tokens N     the eager reference runs at most N tokens
    --ranks R              expert-parallel ranks (R must divide the preset's experts)
    --seed S  --out DIR  --device {auto,cpu,cuda}
    --backend-module PKG.MODULE   import a module that registers your backends (repeatable); installed packages'
                                  ``megamoe.backends`` entry points are loaded too
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys

from .geometry import PRESETS

MAX_TOKENS = 65536  # tokens per rank; the kernels' buffers are sized for 8192 on the H200
MAX_SEED = 2**32 - 1  # seeds are mixed into torch generator seeds (seed * 7919 + rank) and must stay well in 64 bits
DEVICES = ("auto", "cpu", "cuda")
# A spelling of a device that difflib would match to the wrong one ('gpu' is closest to 'cpu').
DEVICE_ALIASES = {"gpu": "cuda", "nvidia": "cuda", "cuda:0": "cuda", "host": "cpu"}
DEFAULT_OUT = "megamoe-results"  # under the current folder, never the repository's committed bench/results


class Parser(argparse.ArgumentParser):
    """argparse, with a close match added to "unrecognized arguments" (``--backend`` -> ``--backends``)."""

    def __init__(self, *a, **kw):
        kw.setdefault("allow_abbrev", False)
        kw.setdefault("formatter_class", lambda prog: argparse.RawDescriptionHelpFormatter(prog, max_help_position=28))
        super().__init__(*a, **kw)

    def error(self, message: str):
        if message.startswith("unrecognized arguments:"):
            flags = [s for a in self._actions for s in a.option_strings]
            for word in message.split(":", 1)[1].split():
                if word.startswith("-"):
                    near = difflib.get_close_matches(word.split("=")[0], flags, n=1, cutoff=0.6)
                    message += f" (did you mean {near[0]}?)" if near else ""
        super().error(message)


def refuse(p: argparse.ArgumentParser, flag: str, value, expected: str, choices=(), suggest: str | None = None) -> None:
    """Exit 2: '<flag>: <value> is not valid; expected <expected>; did you mean <close match>?' (``suggest``: the
    match to offer, where spelling alone would pick the wrong one)."""
    near = [suggest] if suggest else difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.5)
    p.error(f"argument {flag}: {value!r} is not valid; expected {expected}" + (f"; did you mean {near[0]!r}?" if near else ""))


def token_count(text: str) -> int:
    """An argparse type: a whole number of tokens per rank, 1 .. MAX_TOKENS."""
    try:
        n = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens (expected 1 to {MAX_TOKENS})") from None
    if not 1 <= n <= MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"{n} tokens per rank is out of range (expected 1 to {MAX_TOKENS})")
    return n


def positive_int(text: str) -> int:
    try:
        n = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is not positive")
    return n


def seed_value(text: str) -> int:
    """An argparse type: a seed, 0 .. MAX_SEED."""
    try:
        n = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (expected a seed 0 to {MAX_SEED})") from None
    if not 0 <= n <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"{n} is out of range (expected a seed 0 to {MAX_SEED})")
    return n


def add_common(p: argparse.ArgumentParser, *, preset: str, tokens: list[int], backends: str, ref_max: int,
               out_help: str) -> None:
    p.add_argument("--preset", default=preset, metavar="NAME", help=f"{', '.join(PRESETS)} (default {preset})")
    p.add_argument("--tokens", type=token_count, nargs="+", default=tokens, metavar="T",
                   help=f"tokens per rank, a step per value (default {' '.join(map(str, tokens))})")
    p.add_argument("--backends", nargs="+", default=None, metavar="NAME", help=backends)
    p.add_argument("--ref-max-tokens", type=positive_int, default=ref_max, metavar="N",
                   help=f"the reference runs at most N tokens (default {ref_max})")
    p.add_argument("--ranks", type=positive_int, default=1, metavar="R", help="expert-parallel ranks (default 1)")
    p.add_argument("--seed", type=seed_value, default=0, metavar="S", help="seed of weights and inputs (default 0)")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=out_help)
    p.add_argument("--device", default="auto", metavar="{auto,cpu,cuda}", help="auto: cuda if there is a GPU (default auto)")
    p.add_argument("--backend-module", action="append", default=[], metavar="PKG.MODULE",
                   help="import a module that registers your backends, repeatable (default none)")


def load_user_backends(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Before the backend names are checked: installed ``megamoe.backends`` entry points (a broken one is said on
    stderr and skipped), then each --backend-module (one that fails to import is refused, exit 2)."""
    from .fused.registry import load_backend_module, load_entry_points

    _, broken = load_entry_points()
    for ep, why in broken.items():
        print(f"warning: entry point megamoe.backends {ep} not loaded: {why}", file=sys.stderr)
    for module in a.backend_module:
        try:
            added = load_backend_module(module)
        except Exception as exc:  # noqa: BLE001 - the user's module: its error, in one line
            first = (str(exc).strip().splitlines() or [""])[0]
            p.error(f"argument --backend-module: {module!r} could not be imported: {type(exc).__name__}: {first}")
        if not added:
            p.error(f"argument --backend-module: {module!r} registered no backend (it must call "
                    "megamoe.fused.registry.register_backend on import)")


def resolve_common(p: argparse.ArgumentParser, a: argparse.Namespace, backend_names: list[str]) -> None:
    """Validate the shared arguments in place (exit 2 on the first bad one): the preset, the device (cuda only
    where torch sees a GPU), --ranks against the preset's experts, the backend names, the output folder."""
    import torch

    if a.preset not in PRESETS:
        refuse(p, "--preset", a.preset, f"one of {', '.join(PRESETS)}", PRESETS)
    if a.device not in DEVICES:
        refuse(p, "--device", a.device, "one of auto, cpu, cuda", DEVICES, DEVICE_ALIASES.get(str(a.device).lower()))
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("argument --device: 'cuda' is not available here (torch.cuda.is_available() is False: "
                f"torch {torch.__version__} {'has no CUDA support' if torch.version.cuda is None else 'sees no GPU'}); "
                "use --device cpu or auto")
    a.device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    e = PRESETS[a.preset].num_experts
    if e % a.ranks:
        divisors = [r for r in range(1, e + 1) if e % r == 0]
        refuse(p, "--ranks", a.ranks, f"a divisor of the {e} experts of {a.preset!r}: {divisors}", map(str, divisors))
    if a.tokens != sorted(set(a.tokens)):  # one step per count, ascending: said, not done silently
        print(f"note: --tokens {' '.join(map(str, a.tokens))} runs as {' '.join(map(str, sorted(set(a.tokens))))} "
              "(ascending, each count once)", file=sys.stderr)
    a.tokens = sorted(set(a.tokens))
    if a.backends is not None:
        names = [n for n in a.backends if n != "all"]
        for n in names:
            if n not in backend_names:
                refuse(p, "--backends", n, f"names from {', '.join(backend_names)} (or all)", backend_names)
        if "all" in a.backends and names:
            p.error("argument --backends: 'all' already names every backend; give 'all' or names, not both")
    check_out(p, a.out)


def check_out(p: argparse.ArgumentParser, out: str) -> None:
    """Exit 2 unless a results folder can be made under ``out``: not empty, not a file, no file on its way, and
    writable (tried: a folder made and removed in the deepest existing one, so that root on a read-only file system
    is refused too). Nothing is left behind."""
    import tempfile

    if not out.strip():
        p.error("argument --out: '' is not valid; expected a folder path (default megamoe-results)")
    if os.path.exists(out) and not os.path.isdir(out):
        p.error(f"argument --out: {out!r} exists and is not a folder")
    existing = os.path.abspath(out)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        p.error(f"argument --out: cannot create {out!r}: {existing!r} is a file, not a folder")
    try:
        tempfile.TemporaryDirectory(dir=existing, prefix=".megamoe-write-test-").cleanup()
    except OSError as exc:
        p.error(f"argument --out: cannot create {out!r}: {existing!r} is not writable ({exc.strerror or exc})")


def availability() -> dict[str, tuple[bool, str]]:
    """{name: (ok, why not)} of every registered fused backend (``registry.available_backends``): asked once per
    command, then handed to whatever needs it."""
    from .fused.registry import available_backends

    return {name: (ok, why) for name, ok, why in available_backends()}


def unavailable(p: argparse.ArgumentParser, requested: list[str], avail: dict[str, tuple[bool, str]]) -> None:
    """Exit 2 when a named fused backend cannot run here (``avail``: ``availability()``), with the reason, before
    any work."""
    for n in requested:
        if n in avail and not avail[n][0]:
            p.error(f"argument --backends: {n!r} cannot run here: {avail[n][1]}")


def interrupted() -> int:
    """Ctrl-C: one line, no traceback, exit status 130 (the shell's code for SIGINT)."""
    print("\ninterrupted", file=sys.stderr)
    return 130
