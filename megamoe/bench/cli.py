"""``megamoe bench``: arguments and entry point (``megamoe.cli`` wires them; ``megamoe bench --help``).

    megamoe bench                                         # small preset, 1 16 128 tokens, what runs here
    megamoe bench --preset dsv4-flash --tokens 1 8 64 512 --backends flashinfer-mxfp4 reference
    megamoe bench ... --append DIR                        # a second process's rows into DIR (same card)
    megamoe bench --ranks 4                               # the distributed reference over 4 gloo ranks
"""

from __future__ import annotations

import argparse
import json
import os

from ..args import add_common, availability, load_user_backends, positive_int, refuse, resolve_common, unavailable
from .sweep import STUDIES

DESCRIPTION = """\
Time every backend at every token count (tokens per rank) against the card's
ceilings, measured in the same run. Results go to a new folder under --out:
results.json, results.md, sweep.png (bench/README.md says how a number is made)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, preset="small", tokens=[1, 16, 128], ref_max=8192,
               backends="fused backends, reference, or all (default all)",
               out_help="a new results folder under DIR (default megamoe-results)")
    p.add_argument("--warmup-ms", type=float, default=100.0, metavar="MS",
                   help="warm-up of device-bound rows, CUDA (default 100)")
    p.add_argument("--rep-ms", type=float, default=1000.0, metavar="MS",
                   help="time per pass; host-bound rows' budget (default 1000)")
    p.add_argument("--passes", type=positive_int, default=2, metavar="N",
                   help="passes per device-bound case (default 2)")
    p.add_argument("--no-flush", action="store_true", help="keep the L2 between timed calls (default: flush)")
    p.add_argument("--graph", action="store_true", help="also time CUDA-graph replays (default off)")
    p.add_argument("--studies", nargs="*", default=list(STUDIES), metavar="NAME",
                   help="block_m ragged staging overhead (default all)")
    p.add_argument("--append", metavar="DIR", default=None,
                   help="add rows to the results folder DIR (default off)")
    p.add_argument("--deadline-s", type=float, default=None, metavar="S",
                   help="skip what has not begun after S s (default none)")


SWEEP_ONLY = ("warmup_ms", "rep_ms", "passes", "no_flush", "graph", "studies", "append", "deadline_s", "ref_max_tokens")
CUDA_ONLY = ("warmup_ms", "passes", "no_flush", "graph")  # flags of device-bound rows


def validate(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    from .backends import fused_registry

    load_user_backends(p, a)  # before the names are checked: --backend-module and installed entry points
    reg = fused_registry()
    resolve_common(p, a, [*reg, "reference"])
    for s in a.studies:
        if s not in STUDIES:
            refuse(p, "--studies", s, f"names from {', '.join(STUDIES)}", STUDIES)
    for flag, v in (("--warmup-ms", a.warmup_ms), ("--rep-ms", a.rep_ms), ("--deadline-s", a.deadline_s)):
        if v is not None and not v >= 0:
            refuse(p, flag, v, "a number of milliseconds >= 0" if flag != "--deadline-s" else "seconds >= 0")
    if a.ranks > 1:
        given = [f"--{k.replace('_', '-')}" for k in SWEEP_ONLY if getattr(a, k) != p.get_default(k)]
        if given:
            p.error(f"argument {given[0]}: not used with --ranks {a.ranks} (it times the distributed eager reference "
                    f"over gloo ranks by wall clock); drop {', '.join(given)} or use --ranks 1")
        if a.backends not in (None, ["reference"]):
            p.error(f"argument --backends: with --ranks {a.ranks} only 'reference' is timed (the distributed eager "
                    "reference); the fused kernels over several GPUs need the multi-GPU launcher")
        if a.device == "cuda":
            p.error(f"argument --device: --ranks {a.ranks} runs gloo ranks on the CPU; use --device cpu or auto")
        return
    if a.device == "cpu":  # no fused kernel runs on a CPU: every row is the host-bound reference, timed once
        unused = [f"--{k.replace('_', '-')}" for k in CUDA_ONLY if getattr(a, k) != p.get_default(k)]
        if unused:
            p.error(f"argument {unused[0]}: has no effect on a CPU run (its rows are host-bound, timed once for "
                    "--rep-ms); use it with --device cuda")
    if a.ref_max_tokens != p.get_default("ref_max_tokens") and a.backends and not {"all", "reference"} & set(a.backends):
        p.error("argument --ref-max-tokens: the reference is not among --backends, so it would change nothing")
    named = [n for n in (a.backends or []) if n not in ("all", "reference")]
    if named:  # the sweep asks every backend it makes; only the named ones are asked here, before any work
        unavailable(p, named, availability())
    if a.append:
        from .sweep import check_appendable, load_results
        from ..provenance import run_metadata

        try:
            check_appendable(load_results(a.append), config_from_args(a), run_metadata(a.device))
        except ValueError as exc:  # its message may name the flag already: said once
            p.error(f"argument --append: {str(exc).removeprefix('--append: ')}")


def config_from_args(a: argparse.Namespace):
    from .sweep import SweepConfig

    return SweepConfig(preset=a.preset, tokens=list(a.tokens), device=a.device, seed=a.seed,
                       backends=None if a.backends in (None, ["all"]) else list(a.backends), passes=a.passes,
                       warmup_ms=a.warmup_ms, rep_ms=a.rep_ms, flush_l2=not a.no_flush, graph=a.graph,
                       studies=tuple(a.studies), ref_max_tokens=a.ref_max_tokens, deadline_s=a.deadline_s,
                       out_dir=a.out, append_dir=a.append)


def run(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    validate(p, a)
    if a.ranks > 1:
        return run_ranks(a)
    import importlib.util

    from .report import print_tables
    from .sweep import run_sweep

    results = run_sweep(config_from_args(a))
    print_tables(results)
    print(f"results written to {results['out_dir']}")
    if importlib.util.find_spec("matplotlib") is None:
        print("no plots drawn: matplotlib is not installed (pip install 'megamoe[plot]')")
    return 0 if results["rows"] and not results["errors"] else 1


def run_ranks(a: argparse.Namespace) -> int:
    """The distributed eager reference over ``--ranks`` gloo ranks, every rank at T tokens, for each T."""
    from ..distributed.check import bench_ranks
    from ..provenance import new_results_dir, run_metadata

    reports = []
    for t in a.tokens:
        rep = bench_ranks(a.ranks, a.preset, [t] * a.ranks, a.seed)
        print(rep.summary())
        reports.append(rep)
    meta = run_metadata("cpu")
    out = new_results_dir(a.out, meta, f"-ranks{a.ranks}")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"meta": meta, "ranks": a.ranks, "preset": a.preset, "steps": [vars(r) for r in reports]}, f, indent=1)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(f"# megamoe bench --ranks {a.ranks} ({meta['date']}, commit {meta['commit']})\n\n"
                + "\n".join(f"- {r.summary()}" for r in reports) + "\n")
    print(f"results written to {out}")
    return 0
