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
    assert os.path.exists(os.path.join(_folder(tmp_path), "check.md"))


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
    said = " ".join(text.split())
    assert "makes 256 random experts (6.4 G weights)" in said and "minutes on a CPU" in said
    assert said.index("minutes on a CPU") < said.index("the first expert took")
    assert "to make all 256" in said


def test_ctrl_c_exits_130_without_a_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen([sys.executable, "-m", "megamoe", "bench", "--preset", "small", "--tokens", "1", "2", "4",
                          "--out", str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
    assert len(flags) <= 16 and {"--warmup-ms", "--rep-ms", "--no-flush", "--graph", "--passes", "--studies",
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
