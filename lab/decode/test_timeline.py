"""lab/decode/timeline.py: the summary of a launch's stamps (CPU, synthetic stamps whose answers are known by
construction; on an SM90 GPU, a stamped launch of the backend's step: lab/decode/stamps.py)."""

from __future__ import annotations

import pytest
import torch

from lab.decode.timeline import loop_spread, main, stamp_buffer, summarize, table


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


def test_loop_spread_separates_programs_from_their_sms(tmp_path, capsys):
    """Loops of 1,000 / 3,000 cycles on SM 0 (two programs) and 2,000 on SM 1 (one): SD over programs sqrt(2/3) *
    1,000, of the SM means 0 (both 2,000); by programs per SM, 2,000 either way. The CLI prints the same."""
    rows = torch.full((3, 16), -1, dtype=torch.int64)
    rows[:, 0] = torch.tensor([0, 0, 1])
    rows[:, 1], rows[:, 5] = 100, 5000
    rows[:, 11] = torch.tensor([500, 700, 900])
    rows[:, 12] = rows[:, 11] + torch.tensor([1000, 3000, 2000])
    spread = loop_spread(rows)
    assert spread == {"programs": 3, "sd_cycles": round(1000 * (2 / 3) ** 0.5, 1), "sd_of_sm_means_cycles": 0.0,
                      "mean_loop_by_programs_per_sm": {1: 2000.0, 2: 2000.0}}
    idle = rows.clone()
    idle[:, 11:13] = -1  # programs past the work items: no loop
    assert loop_spread(torch.cat([rows, idle]))["programs"] == 3
    f = tmp_path / "stamps.pt"
    l1 = rows.clone()
    l1[:, 9], l1[:, 13] = 0, 9800  # 2 cycles per ns over the 4,900 ns start-to-exit spans
    torch.save({"stamps": [l1, l1[:2]]}, f)
    assert main([str(f)]) == 0
    out = capsys.readouterr().out
    assert "| l1 | start | 0.00 |" in out and "SM clock 2.0 GHz" in out and '"sd_of_sm_means_cycles": 0.0' in out


def test_summary_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match=r"stamps must be int64 \[2, P, 16\], got \(2, 4, 8\)"):
        summarize(torch.zeros(2, 4, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="no gate/up program recorded a start"):
        summarize(torch.full((2, 4, 16), -1, dtype=torch.int64))


def test_stamp_buffers_are_checked_against_the_grid():
    pytest.importorskip("triton", reason="lab/decode/stamps.py needs triton")
    from lab.decode.stamps import check_stamps

    stamps = torch.full((2, 895, 16), -1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"stamps must be int64 \[2, >= 896, 16\] on a GPU \(launch 0's grid "
                                         r"\(7, 64, 2\)\), got \(2, 895, 16\)"):
        check_stamps(stamps, 0, (7, 64, 2), False)
    assert check_stamps(stamps, 1, (6, 64), False).shape == (895, 16)
    with pytest.raises(ValueError, match="under the interpreter"):
        check_stamps(stamps, 1, (6, 64), True)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,skew", ((1, 0.0), (8, 0.0), (32, 3.0)), ids=("T1", "T8", "T32-skewed"))
def test_timeline_on_the_gpu(tokens, skew):
    """One stamped launch of the backend's step (``stamped_step``; route inside gate/up and a split gate/up at 1
    token, a route launch at 8, an expert with more than 4 rows, so passes of 16, at 32 skewed): every program
    records its points in order, down passes its wait only after gate/up's last program has exited (PDL), and
    stamping changes no bit of y."""
    from lab.decode.stamps import stamped_step
    from megamoe.decode import moe_decode
    from megamoe.decode.layout_tc import prepare_tc_weights
    from megamoe.decode.moe import DecodeBuffers
    from megamoe.decode.tc import tc_launch_config
    from megamoe.geometry import get_geometry
    from megamoe.inputs import make_inputs
    from megamoe.staging import stage_into
    from megamoe.weights import random_mxfp4_weights

    g = get_geometry("dsv4-flash")
    tw = prepare_tc_weights(random_mxfp4_weights(g, seed=0, device="cuda"))
    inp = make_inputs(g, tokens, seed=700 + tokens, outlier_channels=4, **({"skew": skew} if skew else {})).to("cuda")
    buf = DecodeBuffers.allocate(g, 64, "cuda", split_tokens=1)
    stage_into(inp.x, inp.topk_idx, inp.topk_weights, buf.x_q, buf.x_sf, buf.topk_idx, buf.topk_weights, tokens,
               num_experts=g.num_experts, backend="torch")
    cfg = tc_launch_config(tokens, g.num_topk)
    buf.poison_()
    y = moe_decode(tw, buf, tokens, g.clamp, cfg).clone()
    buf.poison_()
    stamps = stamp_buffer(buf, (buf.max_work(tokens) + 1) * 128)  # -1: a point no program reached
    y_stamped = stamped_step(tw, buf, tokens, g.clamp, cfg, stamps).clone()
    torch.cuda.synchronize()
    s = stamps.cpu()
    assert torch.equal(y.view(torch.int16), y_stamped.view(torch.int16))
    split = cfg.tc_split
    l1_programs = (buf.max_work(tokens) + cfg.tc_route) * (g.intermediate // 32) * split
    l2_programs = buf.max_work(tokens) * (g.hidden // 64)
    for launch, programs in ((0, l1_programs), (1, l2_programs)):
        ran = s[launch, :, 1] >= 0
        assert int(ran.sum()) == programs and bool(ran[:programs].all()), (launch, int(ran.sum()), programs)
        r = s[launch, :programs]
        assert bool((r[:, 2] >= r[:, 1]).all() and (r[:, 5] >= r[:, 2]).all())
        w = r[r[:, 3] >= 0]  # programs with a work item
        assert w.shape[0] > 0 and bool(((w[:, 3] >= w[:, 2]) & (w[:, 4] >= w[:, 3]) & (w[:, 5] >= w[:, 4])).all())
        assert bool(((r[:, 0] >= 0) & (r[:, 0] < torch.cuda.get_device_properties(0).multi_processor_count)).all())
    assert cfg.pdl and int(s[1, :l2_programs, 2].min()) >= int(s[0, :l1_programs, 5].max())  # L2 waits on all of L1
    if skew:  # the passes of 16 rows ran
        assert int(buf.seg_count[: int(buf.num_touched[0])].max()) > 4
    summary = summarize(stamps)
    assert summary["launches"]["l1"]["programs"] == l1_programs and summary["launches"]["l2"]["programs"] == l2_programs
