"""The ``megamoe`` command line (``megamoe.cli.main``): exit codes, what is printed and written, and every case of
issue 23 with its behaviour now: bad arguments refused before any work (exit 2, the argument, the valid choices
and a close match), flags honoured or refused (never silently ignored), a plain statement of what was checked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import megamoe.check as check_mod
from megamoe.check import DEFAULT_RECIPES
from megamoe.cli import main


def _run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out + out.err


def _folder(parent) -> str:
    (name,) = os.listdir(parent)
    return os.path.join(parent, name)


def test_check_tokens_per_rank_over_simulated_ranks(tmp_path, capsys):
    rc, text = _run(capsys, "check", "--preset", "tiny", "--tokens", "11", "5", "--ranks", "2", "--block-m", "64",
                    "--seed", "3", "--out", str(tmp_path))
    assert rc == 0, text
    for needle in ("error vs the exact recipe per stage", "flashinfer-mxfp4", "deepgemm-sm90-fp8", "L2 in",
                   "rows per expert: min", "EP R=2 BLOCK_M=64 == one rank", "all checks passed", "fused backends"):
        assert needle in text, f"{needle!r} missing from the output:\n{text}"
    doc = json.loads(open(os.path.join(_folder(tmp_path), "check.json")).read())
    assert [r["tokens_per_rank"] for r in doc["reports"]] == [[5, 5], [11, 11]]  # per rank, one step per value
    ys = [e for e in doc["reports"][0]["errors"] if e["stage"] == "y"]
    assert {e["recipe"] for e in ys} == set(DEFAULT_RECIPES) and all(0 < e["calc_diff"] < 5e-3 for e in ys)
    md = open(os.path.join(_folder(tmp_path), "check.md")).read()
    for needle in ("L1", "L2 in", "L2 out", "y [10x", "calc_diff", "rel_l2", "sanity checks", "deepgemm-sm90-fp8"):
        assert needle in md, f"check.md lacks {needle!r}"  # every stage of both steps, not only y
    assert md.count("| deepgemm-sm90-fp4 |") == 4  # two steps x (calc_diff, rel_l2), the full name each time


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without a GPU says")
def test_check_on_a_cpu_says_that_no_fused_kernel_ran(tmp_path, capsys):
    rc, text = _run(capsys, "check", "--preset", "tiny", "--tokens", "4", "--recipes", "flashinfer-mxfp4",
                    "--out", str(tmp_path))
    assert rc == 0 and "no fused kernel ran" in text and "not checked" in text
    doc = json.loads(open(os.path.join(_folder(tmp_path), "check.json")).read())
    assert any(line.startswith("fused kernels: flashinfer-mxfp4 (no GPU") for line in doc["not_checked"])


def test_check_fails_when_ep_differs_from_one_rank(monkeypatch, capsys, tmp_path):
    orig = check_mod.moe_forward

    def off_by_one_ulp(inp, w, recipe, g, **kw):
        y = orig(inp, w, recipe, g, **kw).clone()
        y.view(torch.int16)[0, 0] += 1  # one bf16 ulp in one element
        return y

    monkeypatch.setattr(check_mod, "moe_forward", off_by_one_ulp)
    rc, text = _run(capsys, "check", "--preset", "tiny", "--tokens", "6", "--recipes", "deepgemm-sm90-fp4", "--out",
                    str(tmp_path))
    assert rc == 1 and "FAIL" in text and "1/" in text and "check(s) FAILED" in text


@pytest.mark.parametrize("argv,needles", [
    (["check", "--tokens", "0"], ["--tokens", "out of range", "1 to 65536"]),
    (["check", "--tokens", "1e9"], ["--tokens", "'1e9' is not a whole number"]),
    (["check", "--tokens", "1000000000"], ["--tokens", "out of range"]),
    (["bench", "--preset", "smal"], ["--preset", "'smal'", "dsv4-flash, dsv4-pro, small, tiny", "did you mean 'small'"]),
    (["bench", "--tokens", "-1"], ["--tokens", "out of range"]),
    (["bench", "--device", "gpu"], ["--device", "'gpu'", "auto, cpu, cuda"]),
    (["check", "--backend", "flashinfer"], ["unrecognized arguments: --backend", "did you mean --backends?"]),
    (["check", "--backends", "flashinfer"], ["--backends", "'flashinfer'", "did you mean 'flashinfer-mxfp4'"]),
    (["bench", "--backends", "refrence"], ["--backends", "'refrence'", "deepgemm-staged-fp8", "did you mean 'reference'"]),
    (["check", "--json", "d.json"], ["unrecognized arguments: --json"]),
    (["check", "--ranks", "3", "--preset", "tiny"], ["--ranks", "a divisor of the 8 experts", "[1, 2, 4, 8]"]),
    (["bench", "--studies", "blockm"], ["--studies", "did you mean 'block_m'"]),
    (["check", "--quick"], ["--quick", "no --backends was given"]),
    (["check", "--backends", "all", "--quick", "--tokens", "4"], ["--quick", "already choose the matrix's cases"]),
    (["bench", "--ranks", "2", "--graph"], ["--graph", "not used with --ranks 2"]),
    (["check", "--dist"], ["--dist", "needs --ranks 2 or more"]),
    (["bench", "--backends", "reference", "fake", "--ref-max-tokens", "8"], ["--backends", "'fake'"]),
    (["bench", "--backends", "flashinfer-mxfp4", "--ref-max-tokens", "8"], ["--ref-max-tokens", "would change nothing"]),
], ids=lambda v: " ".join(v) if isinstance(v, list) and v and v[0] in ("check", "bench") else "")
def test_bad_arguments_are_refused_before_any_work(argv, needles, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may be written: the default output folder stays absent
    rc, text = _run(capsys, *argv)
    assert rc == 2, text
    for n in needles:
        assert n in text, f"{n!r} not in:\n{text}"
    assert os.listdir(tmp_path) == [], "work was done (a results folder was made) before the argument was refused"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU build of torch is needed")
def test_cuda_on_a_cpu_build_and_a_kernel_that_cannot_run_here_are_refused_up_front(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for flag in (["--passes", "3"], ["--graph"], ["--no-flush"], ["--warmup-ms", "5"]):
        rc, text = _run(capsys, "bench", *flag)
        assert rc == 2 and f"argument {flag[0]}: has no effect on a CPU run" in text
    rc, text = _run(capsys, "bench", "--device", "cuda")
    assert rc == 2 and "--device" in text and "'cuda' is not available here" in text
    rc, text = _run(capsys, "check", "--backends", "flashinfer-mxfp4")
    assert rc == 2 and "'flashinfer-mxfp4' cannot run here: no GPU" in text
    assert os.listdir(tmp_path) == []


def test_an_output_path_that_is_a_file_is_refused_before_any_work(capsys, tmp_path):
    f = tmp_path / "a-file"
    f.write_text("")
    for cmd in ("check", "bench"):
        rc, text = _run(capsys, cmd, "--out", str(f))
        assert rc == 2 and "--out" in text and "not a folder" in text


def test_check_dist_honours_tokens_and_writes(tmp_path, capsys):
    """Issue 23: `check --ranks 2 --dist --tokens 100 --json d.json` ran [0, 1] and wrote nothing."""
    rc, text = _run(capsys, "check", "--ranks", "2", "--dist", "--tokens", "100", "--preset", "tiny", "--recipes",
                    "flashinfer-mxfp4", "--out", str(tmp_path / "d"))
    assert rc == 0, text
    doc = json.loads(open(os.path.join(_folder(tmp_path / "d"), "check.json")).read())
    assert [x["tokens_per_rank"] for x in doc["dist"]] == [[100, 100]] and doc["dist"][0]["ok"]


def test_bench_ranks_honours_tokens_and_writes(tmp_path, capsys):
    """Issue 23: `bench --ranks 2 --tokens 5 --out d` ran [0, 1] and wrote nothing."""
    rc, text = _run(capsys, "bench", "--ranks", "2", "--tokens", "5", "--preset", "tiny", "--out", str(tmp_path / "d"))
    assert rc == 0, text
    assert "2 gloo ranks" in text and "agreement all-reduce" in text and "tokens [5, 5]" in text
    doc = json.loads(open(os.path.join(_folder(tmp_path / "d"), "results.json")).read())
    assert doc["ranks"] == 2 and [s["tokens_per_rank"] for s in doc["steps"]] == [[5, 5]]


def test_bench_defaults_on_a_cpu_write_a_new_folder_each_run(tmp_path, capsys):
    for k in (1, 2):
        rc, text = _run(capsys, "bench", "--preset", "tiny", "--tokens", "1", "--rep-ms", "10", "--studies",
                        "--out", str(tmp_path))
        assert rc == 0, text
        assert len(os.listdir(tmp_path)) == k  # a rerun never overwrites
    assert "reference us" in text and "results written to" in text
    # True on a CPU: no FP8 ceiling (none is measured), no floor, no device-bound wording, empty studies said
    assert "TFLOP/s" not in text and "floor" not in text and "no FP8 or bf16 ceiling on a CPU" in text
    md = (tmp_path / sorted(os.listdir(tmp_path))[-1] / "results.md").read_text()
    assert "median of" not in md and "device-bound" not in md and "TFLOP/s, bf16" not in md
    assert "(FP8)" not in md and "host-bound rows (+-): mean +- standard error" in md
    for d in os.listdir(tmp_path):
        doc = json.loads((tmp_path / d / "results.json").read_text())
        assert doc["meta"]["versions"]["megamoe"] and doc["meta"]["config"]["preset"] == "tiny" and doc["rows"]


def test_big_presets_on_a_cpu_say_how_long_before_they_start(monkeypatch, capsys, tmp_path):
    """`megamoe check --preset dsv4-flash` on a CPU says what it will do and that it takes minutes before it
    starts, then extrapolates from the first expert made; Ctrl-C (here: right after that expert) exits 130 with
    one line and no traceback."""
    from megamoe.check import prepare

    def first_expert_then_ctrl_c(g, recipes, seed, device, progress=None):
        time.sleep(0.05)
        progress("weights", 1)
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare, "prepare_weights", first_expert_then_ctrl_c)
    rc, text = _run(capsys, "check", "--preset", "dsv4-flash", "--tokens", "4", "--out", str(tmp_path))
    assert rc == 130 and "interrupted" in text and "Traceback" not in text
    assert os.listdir(tmp_path) == [], "an interrupted check left its (empty) report folder"
    said = " ".join(text.split())
    assert "makes 256 random experts (6.4 G weights)" in said and "minutes on a CPU" in said
    assert said.index("minutes on a CPU") < said.index("the first expert took")
    assert "to make all 256" in said


def test_ctrl_c_exits_130_without_a_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # The child gets SIGINT's default disposition: under a parent that ignores it (a job started with & by a
    # non-interactive shell), Python would not install its KeyboardInterrupt handler and the test could not see one.
    p = subprocess.Popen([sys.executable, "-m", "megamoe", "bench", "--preset", "small", "--tokens", "1", "2", "4",
                          "--out", str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while time.time() < deadline and not os.listdir(tmp_path):  # the run has begun: its folder exists
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, out + err
    assert "interrupted" in err and "Traceback" not in err


def test_version_help_and_python_dash_m(capsys):
    from megamoe import __version__

    assert _run(capsys, "--version") == (0, f"megamoe {__version__}\n")
    rc, text = _run(capsys)
    assert rc == 2 and "check" in text and "bench" in text
    rc, text = _run(capsys, "bench", "--help")
    lines = text.splitlines()
    assert rc == 0 and len(lines) <= 40
    flags = [ln.split()[0] for ln in lines if ln.startswith("  --")]
    assert len(flags) <= 17 and {"--warmup-ms", "--rep-ms", "--no-flush", "--graph", "--passes", "--studies",
                                 "--preset", "--tokens", "--backends", "--out", "--seed", "--ranks"} <= set(flags)
    helps = " ".join(lines[lines.index(next(ln for ln in lines if ln.startswith("options:"))):])
    assert helps.count("(default") >= len(flags)  # every flag shows its default
    p = subprocess.run([sys.executable, "-m", "megamoe", "--version"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert p.returncode == 0 and p.stdout.strip() == f"megamoe {__version__}"


def test_the_same_argument_means_the_same_in_both_commands(capsys):
    from megamoe.cli import build_parser

    p = build_parser()
    sub = {a.dest: a for a in p._subparsers._group_actions[0].choices["check"]._actions}
    bench = {a.dest: a for a in p._subparsers._group_actions[0].choices["bench"]._actions}
    for dest in ("preset", "tokens", "backends", "ref_max_tokens", "ranks", "seed", "out", "device"):
        assert sub[dest].option_strings == bench[dest].option_strings and sub[dest].nargs == bench[dest].nargs
        assert sub[dest].type == bench[dest].type
    assert sub["preset"].default == bench["preset"].default == "small"  # seconds on a CPU, in both
    assert bench["tokens"].default == [1, 16, 128] and sub["tokens"].default == [64]
    assert "bench/results" not in sub["out"].default and sub["out"].default == bench["out"].default


# ------------------------------------------------------------------------------------ issue 48: every CLI path
def test_check_dist_runs_the_fp8_recipe_on_its_own_weights(tmp_path, capsys):
    """`check --ranks 2 --dist` died at the FP8 recipe (handed MXFP4 weights); each rank now gets the weights its
    kernel takes, as the single-process check converts them, and the result is bitwise against one process."""
    rc, text = _run(capsys, "check", "--ranks", "2", "--dist", "--preset", "tiny", "--tokens", "3", "--recipes",
                    "deepgemm-sm90-fp8", "megamoe-decode", "--out", str(tmp_path))
    assert rc == 0 and "Traceback" not in text, text
    doc = json.loads(open(os.path.join(_folder(tmp_path), "check.json")).read())
    assert [(d["recipe"], d["result"]) for d in doc["dist"]] == [("deepgemm-sm90-fp8", "bit-identical"),
                                                                ("megamoe-decode", "bit-identical")]
    assert "recipes deepgemm-sm90-fp8, megamoe-decode" in " ".join(doc["checked"])
    assert "| deepgemm-sm90-fp8 | [3, 3] | bit-identical |" in open(os.path.join(_folder(tmp_path), "check.md")).read()


def test_check_dist_says_which_recipe_it_skipped_and_why(tmp_path, capsys, monkeypatch):
    import megamoe.distributed.check as dist_check

    real = dist_check.check_ranks

    def refuse_one(num_ranks, preset, tokens, seed, *, recipe, **kw):
        if recipe == "deepgemm-sm100-fp4":
            raise ValueError("deepgemm-sm100-fp4: experts 0..7: 3 scale bytes outside the window")
        return real(num_ranks, preset, tokens, seed, recipe=recipe, **kw)

    monkeypatch.setattr(dist_check, "check_ranks", refuse_one)
    rc, text = _run(capsys, "check", "--ranks", "2", "--dist", "--preset", "tiny", "--tokens", "2", "--recipes",
                    "deepgemm-sm100-fp4", "flashinfer-mxfp4", "--out", str(tmp_path))
    assert rc == 0, text
    doc = json.loads(open(os.path.join(_folder(tmp_path), "check.json")).read())
    skipped = [line for line in doc["not_checked"] if line.startswith("distributed recipes skipped")]
    assert skipped == ["distributed recipes skipped: deepgemm-sm100-fp4 at 2 tokens per rank (deepgemm-sm100-fp4: "
                       "experts 0..7: 3 scale bytes outside the window)"]
    assert "recipes flashinfer-mxfp4," in " ".join(doc["checked"]) and "skipped: deepgemm-sm100-fp4" in text


@pytest.mark.parametrize("argv,needles", [
    (["--out", "{file}/sub"], ["argument --out", "is a file, not a folder"]),
    (["--out", ""], ["argument --out", "'' is not valid", "a folder path"]),
    (["--seed", "-1"], ["argument --seed", "out of range", "0 to 4294967295"]),
    (["--seed", str(2**64)], ["argument --seed", "out of range"]),
    (["--seed", "1.5"], ["argument --seed", "'1.5' is not a whole number"]),
    (["--device", "gpu"], ["argument --device", "did you mean 'cuda'?"]),
    (["--backend-module", "no_such_module_48"], ["argument --backend-module", "'no_such_module_48' could not be "
                                                 "imported: ModuleNotFoundError"]),
    (["--backend-module", "not a module"], ["argument --backend-module", "is not a module name"]),
    (["--backend-module", "json"], ["argument --backend-module", "'json' registered no backend"]),
])
@pytest.mark.parametrize("command", ["check", "bench"])
def test_more_bad_arguments_are_refused_in_one_line(command, argv, needles, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    rc, text = _run(capsys, command, *(a.replace("{file}", str(tmp_path / "a-file")) for a in argv))
    assert rc == 2 and "Traceback" not in text, text
    for n in needles:
        assert n in text, f"{n!r} not in:\n{text}"
    assert sorted(os.listdir(tmp_path)) == ["a-file"], "work was done before the argument was refused"


@pytest.mark.skipif(not os.access("/proc", os.F_OK), reason="needs /proc (a folder not even root can write in)")
def test_an_unwritable_out_is_refused_even_for_root(capsys):
    rc, text = _run(capsys, "check", "--out", "/proc/megamoe-results")
    assert rc == 2 and "argument --out: cannot create '/proc/megamoe-results'" in text and "not writable" in text


def test_append_errors_name_their_flag_once(capsys, tmp_path):
    rc, text = _run(capsys, "bench", "--preset", "tiny", "--append", str(tmp_path))
    assert rc == 2 and text.count("--append") == 1 + text.count("[--append") and "holds no results.json" in text, text


def test_tokens_reordered_are_said(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, text = _run(capsys, "check", "--tokens", "64", "64", "16", "--quick")  # refused after the tokens are read
    assert rc == 2 and "note: --tokens 64 64 16 runs as 16 64 (ascending, each count once)" in text


def test_an_error_after_the_arguments_is_one_line_and_exit_1(capsys, tmp_path, monkeypatch):
    def boom(**kw):
        raise RuntimeError("the kernel exploded\nsecond line")

    monkeypatch.setattr(check_mod, "run_check", boom)
    monkeypatch.delenv("MEGAMOE_TRACEBACK", raising=False)
    rc, text = _run(capsys, "check", "--preset", "tiny", "--tokens", "2", "--out", str(tmp_path))
    assert rc == 1 and "Traceback" not in text and "second line" not in text
    assert "megamoe check: error: RuntimeError: the kernel exploded (MEGAMOE_TRACEBACK=1 shows where)" in text
    assert os.listdir(tmp_path) == []  # no empty report folder


def test_availability_is_asked_once_per_check_and_one_token_says_not_applicable(capsys, tmp_path, monkeypatch):
    from megamoe.fused.registry import BACKENDS

    calls, depth = [], [0]

    def counting(real, name):
        def availability(cls):  # a probe that asks its parent class's (megamoe-decode-tc) counts once
            calls.extend([name] if depth[0] == 0 else [])
            depth[0] += 1
            try:
                return real(cls)
            finally:
                depth[0] -= 1
        return classmethod(availability)

    for name, cls in BACKENDS.items():
        monkeypatch.setattr(cls, "availability", counting(cls.availability.__func__, name))
    rc, text = _run(capsys, "check", "--preset", "tiny", "--tokens", "1", "--recipes", "flashinfer-mxfp4",
                    "--out", str(tmp_path))
    assert rc == 0, text
    assert sorted(calls) == sorted(BACKENDS), f"availability asked {len(calls)} times: {calls}"
    doc = json.loads(open(os.path.join(_folder(tmp_path), "check.json")).read())
    masked = [s for s in doc["reports"][0]["sanity"] if "fully masked" in s["name"]]
    assert masked and all(s["detail"].startswith("not applicable: no fully masked token") for s in masked)


def test_an_interrupted_bench_leaves_no_results_md_without_rows(capsys, tmp_path, monkeypatch):
    from megamoe.bench import sweep

    def ctrl_c(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep.Sweep, "section_sweep", ctrl_c)
    rc, text = _run(capsys, "bench", "--preset", "tiny", "--tokens", "1", "--studies", "--out", str(tmp_path))
    assert rc == 130 and "Traceback" not in text
    (folder,) = os.listdir(tmp_path)
    assert os.listdir(tmp_path / folder) == ["results.json"]  # its ceilings, and no results.md of headers only


def test_bench_on_a_cpu_says_why_its_studies_are_empty(capsys, tmp_path):
    rc, text = _run(capsys, "bench", "--preset", "tiny", "--tokens", "1", "--rep-ms", "10", "--studies", "overhead",
                    "ragged", "--out", str(tmp_path))
    assert rc == 0, text
    said = " ".join(text.split())
    assert "skipped study overhead: every backend here is host-bound" in said
    assert "skipped study ragged: no fused backend ran here" in said
    md = (tmp_path / _folder(tmp_path) / "results.md").read_text()
    assert "- study overhead: every backend here is host-bound" in md and "- study ragged: no fused backend" in md


# ------------------------------------------------------------------------------------ tables at any width
@pytest.fixture(scope="module")
def long_names_report():
    """A real check report (tiny preset, 2 tokens) over every kernel recipe: long names, 6 columns of numbers."""
    return check_mod.run_check(preset="tiny", tokens=2, seed=5, recipes=list(DEFAULT_RECIPES))


@pytest.mark.parametrize("width,terminal,boxed", [(200, True, True), (80, True, False), (200, False, False)],
                         ids=["terminal-200", "terminal-80", "pipe"])
def test_check_tables_show_full_names_and_numbers_at_any_width(width, terminal, boxed, long_names_report):
    import io

    from rich.console import Console

    from megamoe.check.render import render_report

    report = long_names_report
    console = Console(file=io.StringIO(), width=width, force_terminal=terminal, color_system=None)
    render_report(report, console)
    text = console.file.getvalue()
    assert "…" not in text, "a cell was cut"
    for r in DEFAULT_RECIPES:
        assert f" {r} " in text, f"{r} is not shown in full"
    for e in report.errors:  # every number in full, as check.json has it
        assert f"{e.calc_diff:.2e}" in text or e.calc_diff == 0
    # the stage tables: boxed where they fit (200 columns), else Markdown; a boxed table never passes the width
    assert ("┃ recipe" in text) == boxed and ("| recipe |" in text) == (not boxed)
    assert all(len(line) <= width for line in text.splitlines() if line[:1] in "┏┃┡│└")
    assert terminal or "┃" not in text  # a pipe gets no box at all


@pytest.mark.parametrize("width,terminal", [(200, True), (80, True), (80, False)], ids=["terminal-200", "terminal-80",
                                                                                       "pipe"])
def test_bench_table_shows_full_names_at_any_width(width, terminal):
    import io

    from rich.console import Console

    from megamoe.bench.report import print_tables

    rows = [{"backend": b, "tokens": t, "pass": 0, "us": us, "fused": b != "reference", "weight_format": "mxfp4",
             "host_bound": b == "reference", "statistic": "mean" if b == "reference" else "median", "stderr_us": 3.25,
             "frac_of_floor": 0.5, "frac_of_read": 0.25, "block_m": 8 if b != "reference" else None,
             "floor_mxfp4_us": 1234.5, "bound": "copy", "read_us": 987.6}
            for t, us in ((1, 75.25), (4096, 2919.0)) for b in ("deepgemm-sm90-fp4 [p2]", "flashinfer-mxfp4",
                                                               "reference")]
    results = {"rows": rows, "meta": {"card": "NVIDIA H200", "date": "2026-12-05", "commit": "abc", "gpu": {"n": 1}},
               "ceilings": {"copy_gbps": 4100.0, "fp8_tflops": 1500.0, "bf16_tflops": 750.0}}
    console = Console(file=io.StringIO(), width=width, force_terminal=terminal, color_system=None)
    print_tables(results, console)
    text = console.file.getvalue()
    assert "…" not in text and "deepgemm-sm90-fp4 [p2] us" in text and "flashinfer-mxfp4 us" in text
    assert "2,919 (50%, read 25%, BM 8)" in text and "75.2 (50%, read 25%, BM 8)" in text
    assert "FP8 1,500 TFLOP/s" in text and ("┃" in text) == (terminal and width == 200)


# ------------------------------------------------------------------------------------ a user's backend
QUICKSTART = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "quickstart.md")


def _quickstart_cli_example() -> tuple[str, list[list[str]]]:
    """docs/quickstart.md section 6: the module's source and the two commands, as written there."""
    import re
    import shlex

    text = open(QUICKSTART).read()
    (module,) = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if b.startswith("# my_cpu_backend.py")]
    commands = [shlex.split(line) for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)
                for line in b.splitlines() if "--backend-module" in line]
    assert [c[:2] for c in commands] == [["megamoe", "check"], ["megamoe", "bench"]], commands
    return module, commands


@pytest.fixture
def user_backend_folder(tmp_path, monkeypatch):
    """The quickstart's my_cpu_backend.py in a folder that is the current one; unregistered afterwards."""
    from megamoe.fused import registry

    module, _ = _quickstart_cli_example()
    (tmp_path / "my_cpu_backend.py").write_text(module)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in set(registry.BACKENDS) - registry.BUILTIN:
        registry.unregister_backend(name)
    registry._MODULE_BACKENDS.pop("my_cpu_backend", None)
    sys.modules.pop("my_cpu_backend", None)


@pytest.mark.slow  # about 15 s on 2 cores: a 9-case matrix and a two-backend sweep
def test_the_quickstart_backend_module_runs_through_check_and_bench(user_backend_folder, capsys):
    """`--backend-module` loads the user's FusedBackend and runs it through the same matrix, report and bench as the
    built-in ones: the quickstart's two commands, as written."""
    _, (check_cmd, bench_cmd) = _quickstart_cli_example()
    rc, text = _run(capsys, *check_cmd[1:], "--recipes", "flashinfer-mxfp4")  # one recipe beside: seconds, not 10
    assert rc == 0 and "all checks passed" in text, text
    (folder,) = [d for d in os.listdir(user_backend_folder) if d == "megamoe-results"]
    (report,) = os.listdir(user_backend_folder / folder)
    rows = json.loads((user_backend_folder / folder / report / "matrix-my-cpu-backend.json").read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    assert len(rows) == 9 and {r["status"] for r in rows} == {"pass"}
    assert "fused kernel my-cpu-backend: 9 matrix cases" in (user_backend_folder / folder / report / "check.md").read_text()
    rc, text = _run(capsys, *bench_cmd[1:], "--rep-ms", "10")
    assert rc == 0 and "my-cpu-backend us" in text and "reference us" in text, text


def test_a_megamoe_backends_entry_point_registers_a_backend(user_backend_folder, capsys):
    from megamoe.fused import registry

    info = user_backend_folder / "my_kernels-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-kernels\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[megamoe.backends]\nmine = my_cpu_backend\nbroken = no_such_module_48\n")
    added, failed = registry.load_entry_points()
    assert added == ["my-cpu-backend"] and list(failed) == ["broken = no_such_module_48"]
    assert "ModuleNotFoundError" in failed["broken = no_such_module_48"]
    registry.unregister_backend("my-cpu-backend")
    sys.modules.pop("my_cpu_backend", None)
    rc, text = _run(capsys, "check", "--backends", "my-cpu-backend", "--quick", "--preset", "tiny")  # found by name
    assert rc == 2 and "warning: entry point megamoe.backends broken = no_such_module_48 not loaded" in text
    assert "--quick: --preset / --tokens already choose" in text  # refused for --quick, not for an unknown name


# ------------------------------------------------------------------------------------ the quickstart's H200 block
def test_every_name_the_quickstart_h200_block_uses_exists():
    """The `# H200 only` block cannot run on a CPU; every name it uses is defined before it in the quickstart or
    imported, every import and method exists, the backend it makes is a built-in one, its keyword arguments are
    accepted, and its inputs are made at the geometry and the token count it stages."""
    import ast
    import builtins
    import importlib
    import inspect
    import re

    from megamoe.fused.base import FusedBackend
    from megamoe.fused.registry import BUILTIN

    blocks = re.findall(r"```python\n(.*?)```", open(QUICKSTART).read(), flags=re.S)
    (h200,) = [b for b in blocks if b.startswith("# H200 only")]
    before = blocks[:blocks.index(h200)]
    defined = set(dir(builtins))
    for tree in map(ast.parse, before + [h200]):
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    defined.add((alias.asname or alias.name).split(".")[0])
                    if isinstance(node, ast.ImportFrom):
                        assert hasattr(importlib.import_module(node.module), alias.name), f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.add(node.name)
    tree = ast.parse(h200)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    assert not used - defined, f"undefined in the H200 block: {used - defined}"
    calls = {c.func.attr if isinstance(c.func, ast.Attribute) else c.func.id: c for c in ast.walk(tree)
             if isinstance(c, ast.Call) and isinstance(c.func, (ast.Attribute, ast.Name))}
    for method in ("prepare_weights", "synthetic_weights", "build", "stage", "launch"):
        assert method in calls and hasattr(FusedBackend, method), method
    name = calls["make_backend"].args[0].value
    assert name in BUILTIN, f"make_backend({name!r}): not a built-in backend"
    from megamoe import get_geometry, make_inputs, random_mxfp4_weights
    from megamoe.bench.timing import time_fn

    for fn, call in ((make_inputs, "make_inputs"), (random_mxfp4_weights, "random_mxfp4_weights"),
                     (time_fn, "time_fn"), (FusedBackend.__init__, "make_backend")):
        params = inspect.signature(fn).parameters
        for kw in calls[call].keywords:
            assert kw.arg in params, f"{call}({kw.arg}=...) is not accepted"
    geometry = {ast.unparse(calls[c].args[0]) for c in ("make_inputs", "random_mxfp4_weights", "make_backend")
                if c != "make_backend"} | {ast.unparse(calls["make_backend"].args[1])}
    assert len(geometry) == 1, f"weights, inputs and backend at different geometries: {geometry}"
    assert get_geometry(calls["get_geometry"].args[0].value).num_experts == 256  # the backend's own size
    staged = ast.literal_eval(calls["stage"].args[1])
    assert ast.literal_eval(calls["make_inputs"].args[1]) == staged == ast.literal_eval(calls["launch"].args[0])


def test_the_device_script_runs_the_quickstart_blocks_in_order_with_the_h200_one():
    """bench/device/quickstart.py (what an H200 machine runs) joins every step's block, the H200 one last among
    them and section 6's module file left out, into one script that compiles."""
    import runpy

    mod = runpy.run_path("bench/device/quickstart.py", run_name="quickstart_under_test")
    src = mod["script"]()
    compile(src, "quickstart", "exec")
    blocks = src.split("# --- ")[1:]
    assert "# H200 only" in blocks[-1] and "be.launch(128)" in blocks[-1]
    assert "my_cpu_backend" not in src and len(blocks) >= 6
    fake = "## A\n```python\nx = 1\n```\n## B\n```python\n# my_cpu_backend.py\ny = 2\n```\n```python\nz = x\n```\n"
    assert mod["script"](fake) == "# --- A\nx = 1\n\n# --- B\nz = x\n"
