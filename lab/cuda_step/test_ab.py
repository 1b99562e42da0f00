"""lab/cuda_step/ab.py's table, read from two runs' saved files (run 36's kernel and run 37's LL version, one
H200 each); running the versions needs the H200."""

import json
import pathlib
import shutil
import subprocess
import sys

import pytest
from lab.cuda_step import ab as mod
from lab.cuda_step import testdata

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_PATH = _ROOT / "lab" / "cuda_step" / "ab.py"
_RUNS = _ROOT / "bench" / "results" / "2026-12-04_nvidia-h200_decode-tc"
_SAVED = {  # version folder -> (probe json, selfcheck rows, trace, timeline) of a run
    "1-run36": ("run36-cuda-step1/probe-11.json", "run36-cuda-step1/check-11.jsonl", "run36-trace-784b68b.pt",
                "run36-stamps-784b68b.pt"),
    "2-run37": ("run37-cuda-step1/probe-1.json", "run37-cuda-step1/check-1.jsonl", "run37-trace-4887964.pt",
                "run37-stamps-4887964.pt"),
}
_LATER = {"1-run36": "run36-cuda-step1/probe-10.json"}  # run 36's other run of the same kernel, as a second round


@pytest.fixture
def out(tmp_path):
    for name, (probe, check, trace, stamps) in _SAVED.items():
        d = tmp_path / name
        d.mkdir()
        shutil.copy(_RUNS / probe, d / "step1_probe.json")
        shutil.copy(_RUNS / check, d / "check.jsonl")
        (d / "trace-cuda.pt").write_bytes(testdata.saved(trace))  # (lab/cuda_step/testdata: the saved .pt files)
        (d / "stamps-cuda.pt").write_bytes(testdata.saved(stamps))
    for name, probe in _LATER.items():
        (tmp_path / name / "round-2").mkdir()
        shutil.copy(_RUNS / probe, tmp_path / name / "round-2" / "step1_probe.json")
    (tmp_path / "not-a-version").mkdir()  # no probe file: left out
    return tmp_path


def test_the_table_holds_each_versions_figures(out):
    rows = mod.summarize(out)
    assert [r["version"] for r in rows] == ["1-run36", "2-run37"]
    for r, (probe, check, _, _) in zip(rows, _SAVED.values()):
        saved = json.loads((_RUNS / probe).read_text())
        assert r["commit"] == saved["commit"] and r["same_y"] is True
        assert r["cuda_us"] == saved["rows"]["cuda"]["median_us"]
        assert r["cuda_over_triton"] == pytest.approx(saved["rows"]["cuda"]["median_us"]
                                                      / saved["rows"]["triton"]["median_us"])
        assert r["read_us"] == saved["rows"]["read"]["median_us"]
        extra = [m for m in saved["rows"] if m not in ("cuda", "triton", "read")]
        assert list(r["modes"]) == extra and "bare" in extra
        assert r["modes"]["bare"] == pytest.approx(saved["rows"]["bare"]["median_us"]
                                                   / saved["rows"]["triton"]["median_us"])
        n = sum(1 for line in (_RUNS / check).read_text().splitlines() if line.startswith("{"))
        assert r["checks"] == f"{n} of {n}" and n == 5
        assert 0 < r["stalls_p50_us"] < r["last_found_max_us"]
        assert 0 < r["signal_p50_us"] < 10 and 0 < r["after_input_p50_us"] < 10
    later = json.loads((_RUNS / _LATER["1-run36"]).read_text())["rows"]
    assert rows[0]["rounds"] == [pytest.approx(rows[0]["cuda_over_triton"]),
                                 pytest.approx(later["cuda"]["median_us"] / later["triton"]["median_us"])]
    assert rows[0]["rounds_median"] == pytest.approx(sum(rows[0]["rounds"]) / 2)
    assert rows[1]["rounds"] == [rows[1]["cuda_over_triton"]]


def test_the_summary_prints_from_the_command_line(out):
    run = subprocess.run([sys.executable, str(_PATH), "--summarize", str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "| 1-run36 | 784b68b | 5 of 5 | True | 41.8 (40.4; 40.4) | 42.3 | 0.989 | 0.989 0.971 (0.980) |" in run.stdout
    assert "| 2-run37 | 4887964 | 5 of 5 | True | 43.4 (42.3; 41.3) | 42.3 | 1.026 | 1.026 (1.026) |" in run.stdout
    # the last item's signal, then to done (run 36: 5.888 and 5.296 us, run 37: 1.280 and 6.144, in int64 ns by hand)
    assert "| 5.9, 5.3 |" in run.stdout and "| 1.3, 6.1 |" in run.stdout
    # run 36: 46.11, 41.76, 45.54, 37.18 and 26.4 us against the Triton launches' 42.3
    assert "| cuda_lag1 1.090, bare 0.987, prefetch 1.076, noload 0.879, noload_bare 0.624 |" in run.stdout


def _git(*args):
    return subprocess.run(["git", "-C", str(_ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(not (_ROOT / ".git").exists(), reason="needs the repository's git metadata")
def test_an_export_runs_without_git_and_names_its_commit(tmp_path):
    (d,) = mod.export(["HEAD"], tmp_path, repo=_ROOT)
    head = _git("rev-parse", "--short=10", "HEAD")
    assert (d / "COMMIT").read_text().strip() == head and mod.commit_of(d) == head
    for f in ("megamoe/decode/cuda/cuda_step.cu", "lab/cuda_step/selfcheck.py", "lab/cuda_step/probe.py"):
        assert (d / f).read_bytes() == (_ROOT / f).read_bytes() or _git("status", "--porcelain", f), f
    # of the tests, only the decode checks the lab's scripts import (none at a revision from before they left the package)
    assert {p.name for p in (d / "tests").glob("*")} <= {"decode_selfcheck.py", "decode_tc_selfcheck.py"}
    assert not (d / "bench" / "results").exists()
    assert mod.commit_of(_ROOT) == head
    plain = tmp_path / "plain"
    plain.mkdir()
    assert mod.commit_of(plain) == "unknown"


def test_a_step_past_its_time_is_noted_and_the_comparison_goes_on(tmp_path):
    with open(tmp_path / "x.log", "w") as log:
        mod._run([sys.executable, "-c", "import time; time.sleep(30)"], tmp_path, log, timeout_s=1)
    assert "ran past 1 s and was stopped" in (tmp_path / "x.log").read_text()


def test_a_version_whose_launch_stopped_short_still_gets_its_row(out):
    import torch

    torch.save(torch.full((132, 8), -1, dtype=torch.int64), out / "2-run37" / "stamps-cuda.pt")
    torch.save(torch.full((132, 5, 160), -1, dtype=torch.int64), out / "2-run37" / "trace-cuda.pt")
    rows = mod.summarize(out)
    assert "no set-up stamps" in rows[1]["stamps_error"] and "no issue times" in rows[1]["trace_error"]
    assert "signal_p50_us" not in rows[1] and "stalls_p50_us" not in rows[1]
    assert "| 2-run37 | 4887964 |" in mod.table(rows) and rows[0]["signal_p50_us"] > 0


def test_a_version_whose_probe_left_nothing_is_named_with_its_last_log_line(out):
    d = out / "3-broken"
    d.mkdir()
    (d / "check.log").write_text("Traceback ...\nRuntimeError: no GPU\n")
    (d / "check.jsonl").write_text("")
    (d / "probe.log").write_text("Traceback (most recent call last):\n  ...\nAssertionError: Torch not compiled with CUDA\n\n")
    rows = mod.summarize(out)
    assert [r["version"] for r in rows] == ["1-run36", "2-run37", "3-broken"]
    assert rows[2] == {"version": "3-broken", "checks": "0 of 0",
                       "failed": "AssertionError: Torch not compiled with CUDA"}
    assert "| 3-broken | - | 0 of 0 | - | no probe results: AssertionError: Torch not compiled with CUDA |" in mod.table(rows)


def test_from_round_runs_only_the_later_rounds(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(mod, "run_version", lambda checkout, d, modes: calls.append(("full", d.name)))
    monkeypatch.setattr(mod, "run_round", lambda checkout, d: calls.append(("round", d.parent.name, d.name)))
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    monkeypatch.setattr(sys, "argv", ["ab.py", str(a), str(b), "--out", str(tmp_path / "out"), "--rounds", "3",
                                      "--from-round", "2"])
    assert mod.main() == 0
    assert calls == [("round", "1-a", "round-2"), ("round", "2-b", "round-2"), ("round", "1-a", "round-3"),
                     ("round", "2-b", "round-3")]
    calls.clear()
    monkeypatch.setattr(sys, "argv", ["ab.py", str(a), "--out", str(tmp_path / "out2"), "--rounds", "2"])
    assert mod.main() == 0
    assert calls == [("full", "1-a"), ("round", "1-a", "round-2")]


def test_the_next_runs_script_refuses_a_missing_export(tmp_path):
    """lab/cuda_step/next.sh (the pattern bench, the probes, then the A/B, on the H200) checks its exported
    versions before it runs anything."""
    script = _ROOT / "lab" / "cuda_step" / "next.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    run = subprocess.run(["bash", str(script)], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "AB": str(tmp_path / "none"),
                              "MEGAMOE_CACHE": str(tmp_path / "cache")})
    assert run.returncode == 2 and f"no exported version {tmp_path / 'none'}/main" in run.stderr
    assert not (tmp_path / "out" / "probe.log").exists() and not (tmp_path / "out" / "pattern.txt").exists()
