"""The read ceiling's kernels and its choice among them, on a CPU: the Triton persistent read under Triton's
interpreter (every program reads exactly its tiles, on random words of odd counts), what Triton and nvcc compile
for SM90 (128-bit loads, the hints asked for), ``ReadCeiling`` picking the fastest read and dropping one that
skips words, and the floor record carrying the fastest and the streaming read."""

from __future__ import annotations

import ctypes
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megamoe.bench.ceilings import STREAM, Ceilings, ReadCandidate, ReadCeiling
from megamoe.bench.roofline import achieved, step_floor
from megamoe.geometry import get_geometry

pytest.importorskip("triton", reason="the reads are Triton kernels (pip install triton; CI installs it)")

from megamoe.bench import read_cuda  # noqa: E402
from megamoe.bench import read_kernel as rk  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _interpreted(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh Python under Triton's CPU interpreter (it must be on before triton imports)."""
    path = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=300,
                          check=True, cwd=ROOT)


def _xor(words: np.ndarray) -> int:
    return int(np.bitwise_xor.reduce(words.astype(np.uint32), initial=np.uint32(0)))


def test_the_persistent_triton_read_reads_each_programs_tiles_once(tmp_path):
    """Per program, out[p] must be the xor of tiles p, p + P, ... and, for the last program, of the words past the
    last whole tile: a tile read twice, skipped or given to the wrong program changes some out[p]."""
    t = rk.TILE
    cases = [(random.randint(1, 15), 1, "cg"),  # under 16 bytes: the tail alone
             (3 * t + 2 * random.randint(0, t // 2 - 1) + 1, 2, "plain"),  # odd: tiles 0, 2 | 1 and the tail
             (t + 7, 3, "evict-first")]  # more programs than tiles: program 1 reads nothing, 2 the tail
    script = ("import json, sys, torch\n"
              "from megamoe.bench.read_kernel import read_grid_stride\n"
              "for i, (n, p, hint) in enumerate(json.loads(sys.argv[1])):\n"
              "    buf = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32)\n"
              "    out = read_grid_stride(buf, torch.full((p,), 7, dtype=torch.int32), hint)\n"
              "    torch.save({'buf': buf, 'out': out}, f'{sys.argv[2]}/{i}.pt')\n")
    _interpreted(script, json.dumps(cases), str(tmp_path))
    for i, (n, p, _) in enumerate(cases):
        got = torch.load(tmp_path / f"{i}.pt")
        words = got["buf"].numpy()
        tiles = [words[k * t:(k + 1) * t] for k in range(n // t)]
        want = [_xor(np.concatenate([tiles[k] for k in range(q, len(tiles), p)] or [words[:0]])) for q in range(p)]
        want[-1] ^= _xor(words[n // t * t:])
        assert got["out"].numpy().astype(np.uint32).tolist() == want, (n, p)


def test_the_grids_fit_the_work():
    assert rk.grid_stride_programs(1, 16, 132) == 1  # at least one program
    assert rk.grid_stride_programs(rk.TILE * 10, 4, 132) == 10  # no more programs than tiles
    assert rk.grid_stride_programs(rk.TILE * 10**4, 8, 132) == 8 * 132
    assert read_cuda.cuda_blocks(3, 16, 132) == 1  # three words: block 0's tail alone
    assert read_cuda.cuda_blocks(4 * read_cuda.THREADS * 7 + 4, 16, 132) == 8  # one block per THREADS 16-byte words
    assert read_cuda.cuda_blocks(2**31, 32, 132) == 32 * 132


def test_bad_read_arguments_are_named_before_any_launch():
    buf = torch.randint(-2**31, 2**31 - 1, (64,), dtype=torch.int32)
    out = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="buf must start on a 16-byte boundary"):
        rk.check_read_args(buf[1:], out)
    with pytest.raises(ValueError, match="buf must be a contiguous 1-D int32 tensor, got torch.int64"):
        rk.check_read_args(buf.long(), out)
    with pytest.raises(ValueError, match="out must have one entry per program: 3, got 2"):
        rk.check_read_args(buf, out, 3)
    with pytest.raises(ValueError, match="hint must be one of"):
        rk.read_grid_stride(buf, out, "nc")
    with pytest.raises(ValueError, match="buf must be on a CUDA device, got cpu"):
        read_cuda.read_cuda(buf, out)


@pytest.mark.parametrize("name, bad", [("cuda", "positive integer"), ("cuda/0", "positive integer"),
                                       ("triton-nc/8", "hint must be one of"), ("memcpy/4", "expected cuda/N"),
                                       ("triton-stream/4", "no grid to size")])
def test_read_candidates_are_named_and_parsed(name, bad):
    for good in ("cuda/16", "triton-cg/8", "triton-evict-first/4", "triton-plain/32", STREAM, "torch"):
        assert ReadCandidate.parse(good).name == good
    with pytest.raises(ValueError, match=bad):
        ReadCandidate.parse(name)


def _sm90_loads(kernel, signature: dict, constexprs: dict, divisible: tuple, num_warps: int) -> list[str]:
    """The PTX global loads of ``kernel`` compiled for SM90 on this machine (no GPU needed; ptxas ships with
    Triton), ``divisible``: the arguments Triton is told are multiples of 16."""
    import triton
    from triton.backends.compiler import GPUTarget

    src = triton.compiler.ASTSource(fn=kernel, signature={**signature, **{k: "constexpr" for k in constexprs}},
                                    constexprs=constexprs,
                                    attrs={(kernel.arg_names.index(k),): [["tt.divisibility", 16]] for k in divisible})
    try:
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": 1})
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"Triton cannot compile for SM90 here: {type(exc).__name__}: {str(exc)[:200]}")
    return [line.strip() for line in c.asm["ptx"].splitlines() if "ld.global" in line]


def test_the_persistent_triton_read_issues_128_bit_loads_with_its_hint():
    """Compiled for SM90 as a launch specialises it (pointers 16-byte aligned, n of any value): the loop's loads
    are 128-bit (4 per thread per tile) with the .cg hint; only the tail's are 32-bit. The streaming read, at a
    word count Triton cannot see is a multiple of 16, issues 32-bit loads only: why it was the slower read."""
    per_thread = rk.TILE // (rk.NUM_WARPS * 32) // 4
    loads = _sm90_loads(rk._grid_stride_kernel, {"src": "*i32", "out": "*i32", "n": "i32", "full_tiles": "i32"},
                        {"TILE": rk.TILE, "CACHE": rk.HINTS["cg"][0], "EVICT": rk.HINTS["cg"][1]}, ("src", "out"),
                        rk.NUM_WARPS)
    wide = [x for x in loads if ".v4." in x]
    assert len(wide) == per_thread and all("ld.global.cg.v4" in x for x in wide), loads
    assert all(x.startswith("@") for x in loads if x not in wide)  # the rest: the masked tail
    stream = _sm90_loads(rk._read_kernel, {"src": "*i32", "out": "*i32", "n": "i32"},
                         {"BLOCK": rk.BLOCK, "WAIT": False, "RELEASE": False}, ("src", "out"), 8)
    assert stream and not any(".v4." in x or ".v2." in x for x in stream), stream


def _cuobjdump() -> str | None:
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return shutil.which("cuobjdump") or (str(bundled) if bundled.exists() else None)


@pytest.mark.skipif(read_cuda.nvcc() is None, reason="no nvcc on this machine")
def test_the_cuda_read_builds_for_sm90_with_non_caching_128_bit_loads(tmp_path):
    """nvcc builds read_kernel.cu (about a second) into a library whose constant agrees with the Python side's; in
    its SASS every load of the grid-stride loop is a 128-bit load of the non-caching read-only path
    (LDG.E.NA.128.CONSTANT), the only other load the tail's 32-bit one."""
    lib = read_cuda.build("90a", tmp_path)
    assert read_cuda.build("90a", tmp_path) == lib and len(list(tmp_path.iterdir())) == 1  # cached: built once
    so = ctypes.CDLL(str(lib))
    so.megamoe_read_threads.restype = ctypes.c_int
    assert so.megamoe_read_threads() == read_cuda.THREADS and hasattr(so, "megamoe_read_launch")
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump to read the SASS with")
    sass = subprocess.run([tool, "-sass", str(lib)], capture_output=True, text=True, check=True).stdout
    loads = [line.split(";")[0].split("*/")[-1].strip() for line in sass.splitlines() if " LDG" in line]
    wide = [x for x in loads if "LDG.E.NA.128.CONSTANT" in x]
    assert len(wide) >= 4 and len(loads) - len(wide) == 1 and "LDG.E.CONSTANT" in (set(loads) - set(wide)).pop(), loads


SKIPS_FOUR_WORDS = '''
class SkipsFourWords(ReadCandidate):  # a broken read: the persistent read of all but the buffer's first four words
    @property
    def name(self):
        return "skips-four-words"

    def prepare(self, buf, sms):
        return super().prepare(buf[4:], sms)
'''


def test_the_ceiling_keeps_the_fastest_read_that_read_every_word():
    """Under the interpreter on a CPU (one 'SM', one program each): the read that skips words and the one that
    cannot run here (CUDA) are dropped with a warning, the rest timed; the fastest of them is kept and the
    streaming read's time recorded beside it."""
    nbytes = 4 * (rk.TILE + random.randint(1, rk.TILE - 1)) + random.randint(1, 15)  # not a multiple of 16
    script = ("import json, sys, warnings\n"
              "from megamoe.bench.ceilings import ReadCandidate, ReadCeiling\n" + SKIPS_FOUR_WORDS +
              "cands = [ReadCandidate.parse('triton-plain/1'), ReadCandidate.parse('triton-stream'),\n"
              "         SkipsFourWords('triton', 1), ReadCandidate.parse('cuda/1')]\n"
              "read = ReadCeiling('cpu', candidates=cands, repeats=1, warmup=0)\n"
              "with warnings.catch_warnings(record=True) as w:\n"
              "    warnings.simplefilter('always')\n"
              "    rec = read.record(int(sys.argv[1]))\n"
              "print(json.dumps({**rec, 'warnings': [str(x.message) for x in w], 'how': read.how}))\n")
    rec = json.loads(_interpreted(script, str(nbytes)).stdout.strip().splitlines()[-1])
    assert rec["bytes"] == -(-nbytes // 16) * 16 and rec["bytes"] % 16 == 0
    assert rec["rejected"] == ["skips-four-words"] and "skips-four-words" in rec["warnings"][0]
    assert rec["failed"] == {"cuda/1": "ValueError: buf must be on a CUDA device, got cpu"}  # raised: left out
    assert set(rec["screen_us"]) == {"triton-plain/1", STREAM}  # neither a wrong read nor a failed one is timed
    assert rec["best"] == min(rec["screen_us"], key=rec["screen_us"].get) and rec["us"] > 0 and rec["stream_us"] > 0
    assert rec["how"].startswith("fastest of 4 reads per size")


@pytest.mark.parametrize("compiler", [None, "/bin/false"], ids=["no nvcc", "nvcc fails"])
def test_without_a_cuda_build_the_ceiling_falls_back_to_the_triton_reads_and_says_why(monkeypatch, tmp_path, compiler):
    """On a CUDA device (faked: the candidates are only listed, nothing launches) with no nvcc, or one that fails:
    the Triton reads alone, and the note names the reason."""
    from megamoe.bench.ceilings import BLOCKS_PER_SM, default_candidates

    monkeypatch.setenv("MEGAMOE_CACHE", str(tmp_path))
    monkeypatch.setattr(read_cuda, "nvcc", lambda: compiler)
    monkeypatch.setattr(read_cuda, "arch_of", lambda device: "90a")
    read_cuda.library.cache_clear()
    cands, notes = default_candidates(torch.device("cuda"))
    read_cuda.library.cache_clear()
    assert [c.name for c in cands] == [f"triton-cg/{k}" for k in BLOCKS_PER_SM] + [STREAM]
    why = "building the CUDA read needs nvcc" if compiler is None else "nvcc failed on read_kernel.cu (arch 90a)"
    assert len(notes) == 1 and notes[0].startswith("no CUDA read (RuntimeError: " + why), notes
    assert notes[0].endswith("the Triton reads only") and not list(tmp_path.glob("*.so"))


def test_the_ceiling_on_a_cpu_is_a_torch_sum_measured_once_per_size():
    read = ReadCeiling("cpu", repeats=2)
    nbytes = random.randint(17, 1 << 16)
    rec = read.record(nbytes)
    assert read.record(nbytes + (-nbytes) % 16) is rec and list(read.cache) == [rec["bytes"]]  # same rounded size
    assert rec["best"] == "torch" and rec["us"] > 0 and rec["stream_us"] is None and rec["screen_us"] == {}
    assert rec["rejected"] == [] and rec["failed"] == {}
    assert "no CUDA device" in read.how
    with pytest.raises(ValueError, match="at least one read"):
        ReadCeiling("cpu", candidates=[])


class _Reads:
    """A read ceiling with known figures, for the floor's plumbing alone."""

    def __init__(self, us: float, stream_us: float):
        self.us_, self.stream_us, self.asked = us, stream_us, []

    def record(self, nbytes):
        self.asked.append(nbytes)
        return {"us": self.us_, "best": "cuda/16", "stream_us": self.stream_us}


def test_the_floor_record_carries_the_fastest_and_the_streaming_read():
    g = get_geometry("tiny")
    idx = torch.randint(0, g.num_experts, (random.randint(1, 5), g.num_topk))
    fast, slow = random.uniform(10, 20), random.uniform(21, 40)
    reads = _Reads(fast, slow)
    ceil = Ceilings("cpu", 10.0, 1.0, 1.0)
    fl = step_floor(g, idx, ceil, "mxfp4", read=reads)
    assert reads.asked == [fl.bytes]
    assert (fl.read_us, fl.read_kernel, fl.read_us_stream) == (fast, "cuda/16", slow)
    a = achieved(fl, 50.0, ceil)
    assert a["read_us"] == fast and a["read_us_stream"] == slow and a["read_kernel"] == "cuda/16"
    assert a["frac_of_read"] == pytest.approx(fast / 50) and a["frac_of_read_stream"] == pytest.approx(slow / 50)


def test_the_sweep_table_shows_the_fastest_read_and_the_streaming_read_beside_it():
    from megamoe.bench.report import sweep_table

    fast, slow, us = random.uniform(20, 30), random.uniform(31, 40), random.uniform(41, 90)
    row = {"backend": "k", "tokens": 1, "pass": 0, "fused": True, "weight_format": "mxfp4", "floor_mxfp4_us": 18.9,
           "bound": "HBM", "us": us, "statistic": "median", "frac_of_floor": 18.9 / us, "read_us": fast,
           "read_kernel": "cuda/16", "read_us_stream": slow, "frac_of_read": fast / us, "block_m": None}
    head, body = sweep_table({"rows": [row]})
    line = dict(zip(head, body[0]))
    assert line["read us, MXFP4 bytes"] == f"{fast:.1f} (cuda/16)" and line["streaming read us"] == f"{slow:.1f}"
    assert f"read {100 * fast / us:.0f}%" in line["k us"]
    head, _ = sweep_table({"rows": [{**row, "read_us_stream": None}]})  # no streaming read measured: no column
    assert "streaming read us" not in head
