"""megamoe.decode.timeline: the summary of a launch's stamps (CPU, synthetic stamps whose answers are known by
construction), and the launchers refusing a stamps buffer they cannot fill."""

from __future__ import annotations

import pytest
import torch

from megamoe.decode.timeline import stamp_buffer, summarize, table


def _stamps(l1: list, l2: list, programs: int = 8) -> torch.Tensor:
    """l1 / l2: (sm, [t1..t5 ns or None], cycles per ns) per program -> int64 [2, programs, 16]."""
    class Buf:
        x_q = torch.empty(0)

    s = stamp_buffer(Buf, programs)
    for launch, progs in enumerate((l1, l2)):
        for p, (sm, ts, ghz) in enumerate(progs):
            s[launch, p, 0] = sm
            for k, t in enumerate(ts, start=1):
                if t is not None:
                    s[launch, p, k] = t
                    s[launch, p, 8 + k] = 10_000 + int(t * ghz)
    return s


def test_summary_reads_points_residency_and_clock():
    g = 2.0  # cycles per ns
    base = 1_000_000_000  # the globaltimer's epoch is arbitrary: times are from L1's first start
    l1 = [(0, [base, base + 500, base + 1000, base + 9000, base + 10000], g),
          (0, [base + 100, base + 600, base + 1100, base + 9100, base + 10100], g),
          (1, [base + 200, base + 700, None, None, base + 800], g)]  # past the work items: 1, 2, 5 only
    l2 = [(0, [base + 10200, base + 11000, base + 11500, base + 20000, base + 21000], g),
          (1, [base + 900, base + 11000, base + 11600, base + 20100, base + 21000], g)]
    s = summarize(_stamps(l1, l2))
    a, b = s["launches"]["l1"], s["launches"]["l2"]
    assert (a["programs"], a["working"], a["sms"], b["programs"], b["working"], b["sms"]) == (3, 2, 2, 2, 2, 2)
    assert a["max_resident_per_sm"] == 2  # SM 0 held both working L1 programs at once
    assert b["max_resident_per_sm"] == 1  # on SM 0 the L2 program started after the L1 ones exited
    assert a["at_us"]["start"]["min"] == 0.0 and a["at_us"]["start"]["max"] == 0.2
    assert a["at_us"]["loop done"]["max"] == 9.1 and b["at_us"]["exit"]["max"] == 21.0
    assert b["at_us"]["waited"]["min"] == 11.0
    assert a["loop_cycles"]["min"] == 16_000 and a["loop_us"]["max"] == 8.0
    assert s["clock_ghz"] == 2.0
    assert s["timer_step_ns"] == 100
    assert "| l2 | exit | 21.00 |" in table(s)


def test_summary_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match=r"stamps must be int64 \[2, P, 16\], got \(2, 4, 8\)"):
        summarize(torch.zeros(2, 4, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="no L1 program recorded a start"):
        summarize(torch.full((2, 4, 16), -1, dtype=torch.int64))


def test_launchers_refuse_a_stamps_buffer_too_small_or_off_the_gpu():
    from megamoe.decode.tc import _stamps

    class Buf:
        num_touched = torch.zeros(1)
        interpret = False
        stamps = None

    assert _stamps(Buf, 0, (7, 64, 2)) == (Buf.num_touched, False)
    Buf.stamps = torch.full((2, 895, 16), -1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"stamps must be int64 \[2, >= 896, 16\] on a GPU \(launch 0's grid "
                                         r"\(7, 64, 2\)\), got \(2, 895, 16\)"):
        _stamps(Buf, 0, (7, 64, 2))
    ptr, on = _stamps(Buf, 1, (6, 64))
    assert on and ptr.shape == (895, 16)
    Buf.interpret = True
    with pytest.raises(ValueError, match="under the interpreter"):
        _stamps(Buf, 1, (6, 64))
