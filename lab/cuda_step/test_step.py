"""The lab's build of the 1-token CUDA step (step.py, probe_step.cu, probes.cuh): on a CPU, the probe modes it refuses
before anything is built, the LL modes' sync buffer, that its source builds with nvcc into the instances step.py
names, the host checks of two probe building blocks (probes_check.cu), and (slow) that the lab's instance 0 compiles
to the SASS of the step its studies measured (sass_same.STUDIED); on an SM90 GPU, the library's step and the probe modes meant to keep y's
bits, bit for bit against the Triton launches and the reference (selfcheck.py)."""

from __future__ import annotations

import ctypes
import re
import subprocess
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="megamoe.decode needs triton (pip install triton; CI installs it)")

from lab.cuda_step import step  # noqa: E402
from lab.cuda_step.selfcheck import CASES, Y_RIGHT_MODES, passed_step, run_step_case  # noqa: E402
from megamoe.decode import cuda_step  # noqa: E402

needs_nvcc = pytest.mark.skipif(cuda_step.nvcc() is None, reason="no nvcc on this machine")


def test_an_unknown_probe_mode_is_refused_before_anything_is_built():
    unknown = 2 * max(step.MODES.values())
    with pytest.raises(ValueError, match=f"mode must be a sum of MODES' flags .* got {unknown}"):
        step.step(None, None, 0.0, mode=unknown)
    with pytest.raises(ValueError, match="got -1"):
        step.step(None, None, 0.0, mode=-1)
    m = step.MODES
    with pytest.raises(ValueError, match=r"\(touch\+ahead\): besides .* one of \['the step', 'empty'"):
        step.step(None, None, 0.0, mode=m["touch"] | m["ahead"])
    assert step.mode_error(m["regs"] | m["bare"]) is None and step.mode_error(m["plain"]) is None


def test_the_selfcheck_takes_only_the_variants_meant_to_keep_the_bits():
    """A probe mode that leaves y wrong (no wait, relaxed, bare, ...) cannot be checked bit for bit: refused by name
    before anything runs."""
    assert set(Y_RIGHT_MODES) <= set(step.MODES)
    for mode in ("no-wait", "regs-l1+relaxed"):
        with pytest.raises(ValueError, match=rf"mode must be of .*'regs'.* got '{re.escape(mode)}'"):
            run_step_case(CASES[0], mode=mode)
    with pytest.raises(ValueError, match=r"mode 'touch\+ahead' is no kernel instance's"):
        run_step_case(CASES[0], mode="touch+ahead")


def test_the_ll_modes_sync_buffer_holds_the_counts_then_the_ll_words():
    """sync_words: the library's counts, then the LL modes' launch count and LL words at an 8-byte boundary, as
    probes.cuh's LLRows places them (kMaxTopK = 8 items of I/4 + I/32 input words, then 8 items of H/2 output
    words), 8 bytes each."""
    h, i = 4096, 2048
    base = (h // 64 + 8 + 2) & ~1  # LLRows::count, in int32 words
    ll_words = 1 + 8 * (i // 4 + i // 32) + 8 * h // 2
    assert step.sync_words(h, i) == base + 2 * ll_words
    assert cuda_step.sync_words(h) == h // 64 + 9 < base


@pytest.mark.slow  # 14 instances: ~20 s of nvcc on 2 cores
@needs_nvcc
def test_source_builds_with_the_instances_step_py_names(tmp_path):
    lib = ctypes.CDLL(str(step.build(tmp_path)))
    out = (ctypes.c_int * 64)()
    n = lib.lab_step_instances(out, 64)
    assert sorted(out[:n]) == sorted(step.INSTANCES)


@needs_nvcc
def test_the_probe_building_blocks_on_the_host(tmp_path):
    """probes_check.cu: the LL modes' launch flag over 1,600 launches of 1 to 1,024 CTAs in random interleavings, and
    the register stream's way through a CTA's tiles over 864 schedules (each with a control that must fail)."""
    exe = tmp_path / "probes_check"
    build = subprocess.run([cuda_step.nvcc(), "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "-o",
                            str(exe), str(Path(__file__).with_name("probes_check.cu"))], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    lines = run.stdout.strip().splitlines()
    assert run.returncode == 0 and lines[-2:] == ["1600 launches, 0 failed", "nth: 864 cases, 0 failed"], run.stdout


@pytest.mark.slow
@needs_nvcc
def test_the_labs_step_is_the_step_its_studies_measured():
    """The lab's probe_step.cu compiles its instance 0 to the SASS of the library's step at sass_same.STUDIED, byte for
    byte (its copy of the kernel is that step with the probe hooks); another instance differs (the comparison can
    tell), and so does the library's step now, which has none of the probe modes' reads."""
    from lab.cuda_step import sass_same

    if sass_same.cuobjdump() is None:
        pytest.skip("no cuobjdump")
    root = Path(step.__file__).resolve().parents[2]
    known = subprocess.run(["git", "-C", str(root), "cat-file", "-e", f"{sass_same.STUDIED}^{{commit}}"],
                           capture_output=True)
    if known.returncode:
        pytest.skip(f"revision {sass_same.STUDIED} is not in this clone")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "rev").mkdir()
        studied = sass_same.step_sass(sass_same.revision_source(sass_same.STUDIED, work / "rev"), work / "rev")
        lab_source = Path(step.__file__).with_name("probe_step.cu")
        assert sass_same.step_sass(lab_source, work) == studied
        assert sass_same.step_sass(lab_source, work, "step1_kernelILi16EE") != studied  # probe mode touch
        assert sass_same.step_sass(cuda_step.SOURCE, work, sass_same.LIBRARY_STEP) != studied


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.routing}-{c.seed}")
def test_the_library_step_matches_the_triton_launches_and_the_reference(case):
    row = run_step_case(case, repeats=4)
    assert passed_step(row), row


@pytest.mark.gpu
@pytest.mark.parametrize("mode", Y_RIGHT_MODES)
def test_each_variant_meant_to_keep_the_bits_does(mode):
    row = run_step_case(CASES[0], repeats=2, mode=mode)
    assert passed_step(row), row
