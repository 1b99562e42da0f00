"""``megamoe check``: arguments and entry point (``megamoe.cli`` wires them; ``megamoe check --help``).

    megamoe check                                          # small preset, 64 tokens, every recipe vs exact (CPU)
    megamoe check --tokens 1 64 512 --ranks 4              # per rank, 4 simulated EP ranks, each count a step
    megamoe check --backends flashinfer-mxfp4              # + its differential matrix (SM90)
    megamoe check --ranks 2 --dist                         # real gloo ranks instead of simulated ones
    megamoe check --backend-module my_kernels --backends my-kernel --preset small --tokens 7   # your backend
"""

from __future__ import annotations

import argparse
import json
import os

from ..args import add_common, availability, load_user_backends, positive_int, refuse, resolve_common, unavailable
from ..recipe import MMA_MODELS, RECIPES

DESCRIPTION = """\
Run every stage of every kernel recipe against the exact reference on this
machine (a CPU is fine), with sanity checks (EP == one rank, no NaN, masked
tokens give zero rows), and each fused backend named with --backends through
its differential matrix. Ends with what was and was not checked."""
KERNEL_RECIPES = [r for r in RECIPES if r != "exact"]
MATRIX_ONLY = ("mma", "quick", "deadline_s", "ref_max_tokens")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, preset="small", tokens=[64], ref_max=512,
               backends="fused backends to run the matrix of, or all (default none)",
               out_help="a new report folder under DIR (default megamoe-results)")
    p.add_argument("--recipes", nargs="+", default=None, metavar="NAME",
                   help="kernel recipes compared with exact (default all)")
    p.add_argument("--block-m", type=positive_int, default=8, metavar="BM", help="pool padding BLOCK_M (default 8)")
    p.add_argument("--dist", action="store_true", help="real gloo ranks, not simulated (default off)")
    p.add_argument("--mma", default="sm90-fp8-tc-operands", metavar="MODEL",
                   help=f"matrix: the reference's tensor-core model, one of {', '.join(MMA_MODELS)} "
                        "(default sm90-fp8-tc-operands, bit-exact on the H200's test vectors)")
    p.add_argument("--quick", action="store_true", help="matrix: the shorter case list (default off)")
    p.add_argument("--deadline-s", type=float, default=None, metavar="S",
                   help="matrix: skip cases not begun after S s (default none)")


def validate(p: argparse.ArgumentParser, a: argparse.Namespace, explicit: set[str]) -> dict[str, tuple[bool, str]]:
    """Exit 2 on the first bad argument; returns every fused backend's availability, asked here once."""
    from ..fused.registry import BACKENDS

    load_user_backends(p, a)  # before the names are checked: --backend-module and installed entry points
    resolve_common(p, a, list(BACKENDS))
    for r in a.recipes or []:
        if r not in KERNEL_RECIPES:
            refuse(p, "--recipes", r, f"names from {', '.join(KERNEL_RECIPES)}", KERNEL_RECIPES)
    if a.mma not in MMA_MODELS:
        refuse(p, "--mma", a.mma, " or ".join(MMA_MODELS), MMA_MODELS)
    if a.deadline_s is not None and not a.deadline_s >= 0:
        refuse(p, "--deadline-s", a.deadline_s, "seconds >= 0")
    if not a.backends:
        given = [f"--{k.replace('_', '-')}" for k in MATRIX_ONLY if getattr(a, k) != p.get_default(k)]
        if given:
            p.error(f"argument {given[0]}: applies to a fused backend's matrix, and no --backends was given")
    if a.quick and explicit & {"--preset", "--tokens"}:
        p.error("argument --quick: --preset / --tokens already choose the matrix's cases; give one or the other")
    if a.dist and a.device == "cuda":
        p.error("argument --device: --dist spawns gloo ranks on the CPU; use --device cpu or auto")
    if a.dist and a.ranks < 2:
        p.error("argument --dist: needs --ranks 2 or more (it spawns one process per rank)")
    avail = availability()
    if a.backends == ["all"]:  # every backend that runs here and is not a teaching kernel (FusedBackend.in_all)
        from ..fused.registry import all_backend_names

        a.backends = [n for n in all_backend_names() if avail.get(n, (False, ""))[0]]
    else:
        unavailable(p, a.backends or [], avail)
    return avail


def run(p: argparse.ArgumentParser, a: argparse.Namespace, explicit: set[str]) -> int:
    """The check: the reference recipes (simulated or, with --dist, real ranks), then each --backends matrix; the
    report folder is made after validation and removed again if the run stops before writing anything into it."""
    from rich.console import Console

    from ..provenance import new_results_dir, run_metadata
    from .render import render_backends, render_summary

    avail = validate(p, a, explicit)
    console = Console()
    recipes = a.recipes or KERNEL_RECIPES
    out = new_results_dir(a.out, run_metadata(a.device), "-check")
    try:
        doc = {"arguments": {k: v for k, v in vars(a).items() if k not in ("run", "parser")}, "reports": [],
               "dist": [], "matrix": {}, "checked": [], "not_checked": [], "failed": 0}
        if a.dist:
            run_dist_checks(a, recipes, console, doc)
        else:
            run_single_process(a, recipes, console, doc)
        render_backends([(n, ok, why) for n, (ok, why) in avail.items()], console)
        run_matrices(a, out, explicit, avail, console, doc)
        render_summary(doc["checked"], doc["not_checked"], doc["failed"], console)
        write_report(out, doc)
    except BaseException:  # Ctrl-C or an error: no report folder left empty (a matrix's rows so far stay)
        remove_if_empty(out)
        raise
    console.print(f"report written to {out}", markup=False, highlight=False)
    return 1 if doc["failed"] else 0


def remove_if_empty(folder: str) -> None:
    try:
        os.rmdir(folder)  # only succeeds on an empty folder
    except OSError:
        pass


def run_single_process(a: argparse.Namespace, recipes: list[str], console, doc: dict) -> None:
    reports = run_reference_checks(a, recipes, console)
    doc["reports"] = [r.to_dict() for r in reports]
    doc["failed"] += sum(not s.ok for r in reports for s in r.sanity)
    doc["checked"].append(f"the reference recipes {', '.join(recipes)} against exact, every stage (x, L1, L2 in, L2 out, "
                          f"y), preset {a.preset}, {a.tokens} tokens per rank over {a.ranks} simulated rank(s), on "
                          f"{a.device}")
    masked = "fully masked tokens give zero rows" + ("" if min(a.tokens) >= 2 else
                                                     " (at 2 tokens per rank or more: a 1-token step has none)")
    doc["checked"].append(f"EP over {a.ranks} rank(s) bit-identical to one rank at BLOCK_M 1; no NaN; {masked}")
    doc["not_checked"].append("real distributed ranks (megamoe check --ranks 2 --dist)")


def run_dist_checks(a: argparse.Namespace, recipes: list[str], console, doc: dict) -> None:
    """Every recipe over ``--ranks`` real gloo ranks, each handed the weights its kernel takes (as the single-process
    check converts them). A recipe whose weights cannot be made is skipped and said; a rank that fails is a failed
    check with its one-line reason."""
    from ..distributed.check import check_ranks
    from ..distributed.launch import RankError

    ran, skipped = [], []
    for t in a.tokens:
        for r in recipes:
            console.print(f"distributed reference: recipe {r}, {a.ranks} ranks x {t} tokens ...", markup=False,
                          highlight=False)
            entry = {"recipe": r, "tokens_per_rank": [t] * a.ranks, "ok": False, "result": "", "mismatches": {}}
            try:
                rep = check_ranks(a.ranks, a.preset, [t] * a.ranks, a.seed, recipe=r, block_m=a.block_m)
            except ValueError as exc:  # the recipe's weights or its setup refused before any rank ran
                entry["result"] = f"skipped: {exc}"
                skipped.append(f"{r} at {t} tokens per rank ({exc})")
            except RankError as exc:
                entry["result"] = f"FAIL: {str(exc).splitlines()[0]}"
                doc["failed"] += 1
            else:
                console.print(rep.summary(), markup=False, highlight=False)
                entry.update(ok=rep.ok, result="bit-identical" if rep.ok else "MISMATCH",
                             mismatches={" ".join(map(str, k)): v for k, v in rep.mismatches.items()})
                doc["failed"] += not rep.ok
                ran.append(r)
            if entry["result"].startswith(("skipped", "FAIL")):
                console.print(f"  {entry['result']}", markup=False, highlight=False)
            doc["dist"].append(entry)
    ran = list(dict.fromkeys(ran))
    if ran:
        doc["checked"].append(f"the distributed reference over {a.ranks} real gloo ranks, bitwise against the "
                              f"single-process reference: recipes {', '.join(ran)}, {a.tokens} tokens per rank, "
                              f"preset {a.preset}")
    if skipped:
        doc["not_checked"].append("distributed recipes skipped: " + "; ".join(skipped))


def run_matrices(a: argparse.Namespace, out: str, explicit: set[str], avail: dict, console, doc: dict) -> None:
    """Each fused backend named with --backends through its differential matrix; then what did not run and why."""
    from .. import check
    from .matrix import run_matrix, selected_cases
    from .render import render_matrix

    for name in a.backends or []:
        # --preset / --tokens given: the matrix at that geometry and those counts (else its own full case list)
        cases = selected_cases(name, a.preset, a.tokens) if explicit & {"--preset", "--tokens"} else None
        rows = run_matrix(name, cases, os.path.join(out, f"matrix-{name}.json"), mma=a.mma, quick=a.quick,
                          deadline_s=a.deadline_s, ref_max_tokens=a.ref_max_tokens)
        render_matrix(name, rows, console)
        doc["matrix"][name] = rows
        bad = [r for r in rows if r.get("status") in check.MATRIX_BAD]
        doc["failed"] += len(bad)
        skipped = [r for r in rows if r.get("status") == "skipped"]
        doc["checked"].append(f"fused kernel {name}: {len(rows) - len(skipped)} matrix cases against its faithful "
                              f"reference, {len(bad)} bad")
        if skipped:
            doc["not_checked"].append(f"{name}: {len(skipped)} matrix cases not begun by --deadline-s {a.deadline_s}")
    ran = set(a.backends or [])
    missing = [f"{n} ({why})" if not ok else f"{n} (runs here: megamoe check --backends {n})"
               for n, (ok, why) in avail.items() if n not in ran]
    if missing:
        doc["not_checked"].append(("fused kernels: " if not ran else "other fused kernels: ") + "; ".join(missing))


def run_reference_checks(a: argparse.Namespace, recipes: list[str], console) -> list:
    """Every token count through ``run_check`` on weights made once. A preset of DeepSeek-V4 size takes minutes
    on a CPU: it says so before starting, shows a progress bar with the time left, and extrapolates the weights'
    cost from the first expert made."""
    import time

    from .. import check
    from ..geometry import get_geometry
    from ..progress import Progress
    from .prepare import prepare_weights
    from .render import render_report

    g = get_geometry(a.preset)
    n_weights = g.num_experts * 3 * g.hidden * g.intermediate
    big = n_weights >= 10**8  # DeepSeek-V4: minutes on a CPU; small and tiny: seconds
    if big:
        console.print(f"megamoe check: preset {a.preset} makes {g.num_experts} random experts ({n_weights / 1e9:.1f} G "
                      f"weights) and converts them for {len(recipes)} recipes on {a.device}, then runs "
                      f"{len(a.tokens)} step(s) per recipe: minutes on a CPU. Progress and the time left below; "
                      "Ctrl-C stops it.")
    reports, t0, first, current = [], time.perf_counter(), [], ["weights"]

    def on_weights(phase: str, n: int) -> None:  # one bar per phase: making the experts, each conversion
        if phase != current[0]:
            current[0] = phase
            prog.phase(phase, g.num_experts)
        prog.step(phase, n)
        if big and phase == "weights" and not first:
            first.append(time.perf_counter() - t0)
            console.print(f"the first expert took {first[0]:.1f} s: about {_duration(first[0] * g.num_experts)} to make "
                          f"all {g.num_experts}, then their conversions and the forwards")

    with Progress(True, g.num_experts, "weights") as prog:  # a bar at every size: a busy host makes seconds minutes
        cw = prepare_weights(g, recipes, a.seed, a.device, progress=on_weights)
        prog.phase("forwards", len(a.tokens) * (1 + len(recipes)))
        for t in a.tokens:
            reports.append(check.run_check(preset=a.preset, tokens=t, seed=a.seed, block_m=a.block_m, ranks=a.ranks,
                                           recipes=recipes, device=a.device, weights=cw,
                                           step=lambda ph, t=t: prog.step(f"T={t}: {ph}")))
    for r in reports:
        render_report(r, console)
    return reports


def _duration(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min"


def write_report(out: str, doc: dict) -> None:
    """check.json (the whole document) and check.md (``render.report_markdown``: every stage, not only y)."""
    from .render import report_markdown

    with open(os.path.join(out, "check.json"), "w") as f:
        json.dump(doc, f, indent=1, default=str)
    with open(os.path.join(out, "check.md"), "w") as f:
        f.write(report_markdown(doc))
