"""Versions of the 1-token CUDA step side by side on one H200 with nvcc. For each checkout directory, in turn on the
same card: its selfcheck (the step's bits against the Triton launches and the reference) and its probe (the step
beside the Triton launches, the probe modes ``--modes`` names and a plain read, in one process, with a trace of one
launch). Then one table.

    git worktree add build/adopt step1-adopt && git worktree add build/adopt-ew step1-adopt-ew
    python3 lab/cuda_step/ab.py . build/adopt build/adopt-ew --out $OUT --rounds 3 --modes touch
    python3 lab/cuda_step/ab.py --summarize $OUT          # the table again, on any machine

Compare versions by each probe's ratio to its own Triton launches (code every checkout shares): each checkout
runs in its own processes, so their absolute times are further apart than two launches in one process. With
``--rounds N`` the versions then take turns N - 1 more times (A B C A B C ...), each turn a short probe of the
step, the Triton launches and the read alone, so that a version's ratio is seen in several processes spread over
the run: the table gives each round's ratio and their median. Where the rounds do not fit in one run,
``--from-round R`` runs only rounds R.. into a second folder, whose round folders then join the first's.
Files: $OUT/<i>-<name>/{check.jsonl, check.log, probe.log, step1_probe.json, stamps-cuda.pt, trace-cuda.pt,
round-<r>/step1_probe.json}, $OUT/summary.md.

Where the machine that runs them has no git metadata, export the versions first, on a machine that has it: each
revision's package and device scripts, with a COMMIT file that names it (the probes record it):

    python3 lab/cuda_step/ab.py --export build/ab main step1-adopt step1-adopt-ew
    python3 lab/cuda_step/ab.py build/ab/* --out $OUT --rounds 3 --modes touch          # then, on the H200"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))  # the repository root: megamoe and lab
import torch

from lab.cuda_step.stamps import last_item  # noqa: E402
from lab.cuda_step.stage_trace import summarize as trace_summary  # noqa: E402


# What a version needs to run its selfcheck and probe: the package, the lab and the tests' decode checks that the
# lab's scripts import (versions before the lab existed kept their probes in bench/device, and their checks in the
# package; each path is exported where the revision has it).
EXPORTED = ("megamoe", "lab", "bench/device", "tests/decode_selfcheck.py", "tests/decode_tc_selfcheck.py")
PROBE_SCRIPTS = ("lab/cuda_step/probe.py", "bench/device/probe.py")  # the probe, where a version keeps it
# Its selfcheck: a script in the lab, or (versions before it moved there) a module of the package.
SELFCHECKS = (("lab/cuda_step/selfcheck.py",), ("-m", "megamoe.decode.selfcheck_step1"))


def selfcheck_command(checkout: Path) -> list[str]:
    """The command that runs a checkout's selfcheck of the step (``SELFCHECKS``: the first the checkout has)."""
    for cmd in SELFCHECKS:
        if cmd[0] == "-m" or (checkout / cmd[0]).exists():
            return [sys.executable, *cmd]
    return [sys.executable, *SELFCHECKS[-1]]


def commit_of(checkout: Path) -> str:
    """The version a checkout holds: its COMMIT file (an export), else its own git HEAD, else 'unknown'."""
    if (checkout / "COMMIT").exists():
        return (checkout / "COMMIT").read_text().strip()
    if (checkout / ".git").exists():  # its own checkout or worktree, not a folder inside another one
        run = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short=10", "HEAD"], capture_output=True,
                             text=True, check=False)
        if run.returncode == 0:
            return run.stdout.strip()
    return "unknown"


def export(revisions: list[str], dest: Path, repo: Path = Path(".")) -> list[Path]:
    """Each revision's EXPORTED folders into dest/<revision> (a '/' becomes '-'), with its short hash in COMMIT."""
    out = []
    for rev in revisions:
        commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=10", rev], capture_output=True,
                                text=True, check=True).stdout.strip()
        d = dest / rev.replace("/", "-")
        d.mkdir(parents=True, exist_ok=True)
        have = [p for p in EXPORTED if subprocess.run(["git", "-C", str(repo), "cat-file", "-e", f"{rev}:{p}"],
                                                      capture_output=True).returncode == 0]
        archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", rev, *have],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(d)], input=archive, check=True)
        (d / "COMMIT").write_text(commit + "\n")
        out.append(d)
    return out


def _run(cmd: list[str], checkout: Path, log, timeout_s: int, stdout=None) -> None:
    """One step of a version, with the version's package first on the path and its commit named; a step that runs
    past its time is noted in its log and the comparison goes on."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "MEGAMOE_COMMIT": commit_of(checkout)}
    try:
        subprocess.run(cmd, cwd=checkout, env=env, stdout=stdout or log, stderr=log if stdout else subprocess.STDOUT,
                       timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        log.write(f"\n[step1_ab] {' '.join(cmd[1:3])} ran past {timeout_s} s and was stopped\n")


def _probe(checkout: Path, out: Path, extra: list[str], timeout_s: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "probe.log", "w") as log:
        script = next((s for s in PROBE_SCRIPTS if (checkout / s).exists()), PROBE_SCRIPTS[0])
        _run([sys.executable, script, "--out", str(out), "--stages", "--inflight", "--lags",
              *extra], checkout, log, timeout_s)


def run_version(checkout: Path, out: Path, modes: list[str], timeout_s: int = 300) -> None:
    """The selfcheck and the probe of one checkout, with its own package on the path, into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "check.jsonl", "w") as rows, open(out / "check.log", "w") as log:
        _run([*selfcheck_command(checkout), "--repeats", "4"], checkout, log, timeout_s, stdout=rows)
    _probe(checkout, out, ["--modes", *modes, "--timelines", "cuda", "--traces", "cuda"], timeout_s)


def run_round(checkout: Path, out: Path, timeout_s: int = 120) -> None:
    """A later round of one checkout: the step, the Triton launches and the read, nothing else."""
    _probe(checkout, out, ["--modes", "--timelines", "--traces"], timeout_s)


def _ratio(rows: dict) -> float | None:
    """A probe's step against its own Triton launches (median over median), None where either is missing."""
    if "cuda" not in rows or "triton" not in rows:
        return None
    return rows["cuda"]["median_us"] / rows["triton"]["median_us"]


def _figures(path: Path, read, pick: dict[str, tuple[str, str]]) -> dict:
    """The figures ``read`` gives of a saved file (``pick``: row key -> (section, figure)), none if it is missing. A
    file that holds too little (a launch that stopped short) gives its reason under "<file stem>_error" instead, and
    the table goes on."""
    if not path.exists():
        return {}
    try:
        s = read(torch.load(path))
    except ValueError as exc:
        return {f"{path.stem.split('-')[0]}_error": str(exc)}
    return {key: s[section][figure] for key, (section, figure) in pick.items()}


def _last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.exists() else []
    return lines[-1][:200] if lines else "no log"


def summarize(out: Path) -> list[dict]:
    """One row per version folder of ``out`` (in their order): checks passed, the step and the Triton launches
    (median us, p10, kineto), their ratio, a plain read, and the trace's stalls and last stage found. A version
    whose probe left no results gets a row that says so, with the last line of its probe's log."""
    rows = []
    for d in sorted(p for p in out.iterdir() if (p / "step1_probe.json").exists() or (p / "probe.log").exists()):
        check_file = d / "check.jsonl"
        checks = ([json.loads(line) for line in check_file.read_text().splitlines() if line.startswith("{")]
                  if check_file.exists() else [])
        row = {"version": d.name, "checks": f"{sum(bool(c.get('passed')) for c in checks)} of {len(checks)}"}
        if not (d / "step1_probe.json").exists():
            row["failed"] = _last_line(d / "probe.log")
            rows.append(row)
            continue
        probe = json.loads((d / "step1_probe.json").read_text())
        t = probe["rows"]
        row.update(commit=probe.get("commit"), same_y=probe.get("same_y"), cuda_us=t["cuda"]["median_us"],
                   cuda_p10_us=t["cuda"]["p10_us"], triton_us=t["triton"]["median_us"],
                   read_us=t.get("read", {}).get("median_us"),
                   cuda_kernel_us=sum(t["cuda"].get("kineto_us", {}).values()) or None)
        row["cuda_over_triton"] = _ratio(t)
        row["modes"] = {name: r["median_us"] / t["triton"]["median_us"] for name, r in t.items()
                        if name not in ("cuda", "triton", "read")}  # each probe mode's time against the same Triton
        later = sorted(d.glob("round-*/step1_probe.json"), key=lambda f: int(f.parent.name.split("-")[1]))
        ratios = (_ratio(json.loads(f.read_text()).get("rows", {})) for f in later)
        row["rounds"] = [row["cuda_over_triton"], *(r for r in ratios if r is not None)]
        row["rounds_median"] = statistics.median(row["rounds"])
        row.update(_figures(d / "stamps-cuda.pt", last_item, {"signal_p50_us": ("signal_us", "p50"),
                                                              "after_input_p50_us": ("after_input_us", "p50")}))
        row.update(_figures(d / "trace-cuda.pt", trace_summary, {"stalls_p50_us": ("gaps_per_cta_us", "p50"),
                                                                 "last_found_max_us": ("last_found_us", "max")}))
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    head = ("| version | commit | checks passed | same y | step us (p10; kernel) | Triton us | step / Triton | "
            "each round (median) | read us | load stalls per CTA, p50 us | last stage found, max us | "
            "last item: signal, then to done, p50 us | modes / Triton (round 1) |\n"
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    f = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    lines = [f"| {r['version']} | - | {r['checks']} | - | no probe results: {r['failed']} |" if "failed" in r else
             f"| {r['version']} | {r['commit']} | {r['checks']} | {r['same_y']} | {f(r['cuda_us'])} "
             f"({f(r['cuda_p10_us'])}; {f(r['cuda_kernel_us'])}) | {f(r['triton_us'])} | "
             f"{f(r['cuda_over_triton'], 3)} | {' '.join(f(x, 3) for x in r['rounds'])} ({f(r['rounds_median'], 3)}) | "
             f"{f(r['read_us'])} | {f(r.get('stalls_p50_us'))} | {f(r.get('last_found_max_us'))} | "
             f"{f(r.get('signal_p50_us'))}, {f(r.get('after_input_p50_us'))} | "
             f"{', '.join(f'{m} {f(v, 3)}' for m, v in r['modes'].items()) or '-'} |" for r in rows]
    return "\n".join([head, *lines])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkouts", nargs="*", help="repository checkouts, one per version")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--modes", nargs="*", default=["bare", "noload"], help="probe modes every version has")
    ap.add_argument("--rounds", type=int, default=1, help="turns each version takes (the first one full)")
    ap.add_argument("--from-round", type=int, default=1, metavar="R",
                    help="run rounds R.. only: the earlier ones ran before, into another folder of the same layout, "
                         "and the two are merged before --summarize")
    ap.add_argument("--summarize", metavar="OUT", help="only print the table of an earlier run's folder")
    ap.add_argument("--export", metavar="DEST", help="only export the revisions given as checkouts into DEST")
    args = ap.parse_args()
    if args.summarize:
        if not Path(args.summarize).is_dir():
            ap.error(f"--summarize: {args.summarize} is not a folder")
        print(table(summarize(Path(args.summarize))))
        return 0
    if args.export:
        for d in export(args.checkouts, Path(args.export)):
            print(f"[step1_ab] {d} ({commit_of(d)})")
        return 0
    if not args.checkouts or not args.out:
        ap.error("give the checkouts and --out (or --summarize OUT)")
    if args.from_round < 1:
        ap.error(f"--from-round must be at least 1, got {args.from_round}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    versions = [(Path(c).resolve(), out / f"{i}-{Path(c).resolve().name}") for i, c in enumerate(args.checkouts, 1)]
    for checkout, d in versions if args.from_round == 1 else []:
        print(f"[step1_ab] {checkout}", flush=True)
        run_version(checkout, d, args.modes)
    for r in range(max(2, args.from_round), args.rounds + 1):
        for checkout, d in versions:
            print(f"[step1_ab] round {r}: {checkout}", flush=True)
            run_round(checkout, d / f"round-{r}")
    text = table(summarize(out))
    (out / "summary.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
