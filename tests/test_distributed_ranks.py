"""The distributed reference on real torch.distributed ranks (gloo on 127.0.0.1, spawned processes).

Each rank holds its own ragged step (0, 1, 37, 256 tokens on four ranks); every rank's y must match
``moe_forward_ep`` (all ranks in one process) and ``moe_forward`` on the concatenated step bit for
bit, through both schemes and through the fused launcher's path (agreement, padding to the agreed
count, the launch) with the reference as its backend. Failures must reach every rank in bounded time.
"""

from __future__ import annotations

import os
import re
import random
import subprocess
import sys
import time

import pytest
import torch

from megamoe.distributed import LaunchTimeout, RankError, check_ranks, spawn
from megamoe.distributed.check import CHECK_PATHS, rank_inputs
from megamoe.geometry import get_geometry

pytestmark = pytest.mark.dist

RAGGED = [0, 1, 37, 256]
SEED = random.Random().randrange(10_000)  # fresh each session; printed in every failure


def _assert_report_ok(rep):
    assert rep.ok, f"seed {SEED}\n{rep.summary()}"
    # Both references, every path, every rank.
    assert len(rep.mismatches) == rep.num_ranks * len(rep.schemes) * 2
    inputs = rank_inputs(get_geometry(rep.preset), rep.tokens_per_rank, SEED)
    for (r, path), y in rep.ys.items():
        t = rep.tokens_per_rank[r]
        assert y.shape == (t, 256) and y.dtype == torch.bfloat16
        # Not a vacuous match: finite, a zero row exactly where every slot of the token is masked.
        routed = (inputs[r].topk_idx >= 0).any(dim=1)
        assert bool(torch.isfinite(y.float()).all()), (r, path)
        assert torch.equal((y != 0).any(dim=1), routed), (r, path)


def test_four_ranks_ragged_bitwise():
    rep = check_ranks(4, "tiny", RAGGED, seed=SEED, timeout_s=100)
    print(f"\nseed {SEED}\n{rep.summary()}")
    _assert_report_ok(rep)
    assert rep.schemes == CHECK_PATHS
    assert (rep.agreed, rep.hint) == (256, 74)  # max, and ceil(294 / 4)
    for r in range(4):  # the launcher padded every rank to the agreed count and passed the hint
        assert rep.backend_calls[r] == [{"num_tokens": 256, "staged": 256, "plan_hint": 74}]


def test_one_rank_group_same_path():
    """A 1-rank group goes through the same agreement, padding and launch as N ranks."""
    rep = check_ranks(1, "tiny", [37], seed=SEED, timeout_s=60, agree_iters=5)
    print(f"\n{rep.summary()}")
    _assert_report_ok(rep)
    assert rep.backend_calls[0] == [{"num_tokens": 37, "staged": 37, "plan_hint": 37}]


def test_every_rank_empty():
    rep = check_ranks(2, "tiny", [0, 0], seed=SEED, timeout_s=60, agree_iters=2)
    _assert_report_ok(rep)
    assert rep.agreed == 1 and rep.backend_calls[0][0]["num_tokens"] == 1  # the kernels' minimum count


def _rank_error(**inject) -> tuple[RankError, float]:
    """Four ranks with a fault injected; the RankError every launch must end in, and the seconds it took."""
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        check_ranks(4, "tiny", RAGGED, seed=SEED, timeout_s=60, **inject)
    return info.value, time.monotonic() - t0


def test_failing_rank_reported_on_every_rank():
    err, elapsed = _rank_error(_fail_rank=2)
    print(f"\n{err}\n({elapsed:.1f} s)")
    assert elapsed < 60
    assert err.first_rank == 2 and sorted(err.failures) == [0, 1, 2, 3]
    assert "rank 2 failed: RuntimeError: injected failure on rank 2" in err.failures[2]
    assert "Traceback" in err.failures[2]
    for r in (0, 1, 3):
        assert err.failures[r].startswith(f"rank {r}: aborted because rank 2 failed: RuntimeError: injected failure")


def test_geometry_mismatch_reported_on_every_rank():
    err, elapsed = _rank_error(_bad_rank=1)
    print(f"\n{str(err).splitlines()[1]}\n({elapsed:.1f} s)")
    assert elapsed < 60 and sorted(err.failures) == [0, 1, 2, 3]
    for r in range(4):
        msg = err.failures[r]
        assert "SetupMismatchError: the 4 ranks of the group disagree on their setup" in msg, msg
        assert "geometry: ranks [0, 2, 3]: Geometry(name='tiny'" in msg and "clamp=20.0" in msg


def _hang_on_rank_1(rank, world):
    if rank == 1:
        time.sleep(60)
    torch.distributed.barrier()
    return rank


def test_hanging_rank_bounded_by_timeout():
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        spawn(_hang_on_rank_1, 2, timeout_s=8, grace_s=1)
    elapsed = time.monotonic() - t0
    print(f"\n{info.value}\n({elapsed:.1f} s)")
    assert elapsed < 20
    assert "rank 1" in str(info.value)
    if isinstance(info.value, LaunchTimeout):
        assert "timed out after 8 s" in str(info.value)
    else:  # rank 0's barrier timed out first (process-group timeout = 8 s): the same bound
        assert info.value.first_rank == 0


def _torchrun(*extra: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
           "--master-port", str(port), "-m", "megamoe.distributed.run_reference", "--preset", "tiny",
           "--tokens", ",".join(map(str, RAGGED)), "--seed", str(SEED), "--timeout", "60", *extra]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return out, time.monotonic() - t0


def test_torchrun_four_ranks_bitwise():
    out, elapsed = _torchrun()
    text = out.stdout + out.stderr
    lines = [l for l in text.splitlines() if l.startswith("rank ")]
    print(f"\n({elapsed:.1f} s)\n" + "\n".join(lines))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # Counted per rank in the whole text, so that a line split by another rank's write cannot hide one.
    for r in range(4):
        assert len(re.findall(rf"rank {r}/4 T=\S+\s+\S+\s+vs \S+\s+bit-identical", text)) == 2 * 2, r
        assert len(re.findall(rf"rank {r}/4 agreement: .*?agreed 256, hint 74", text)) == 1, r
    assert "MISMATCH" not in text


def test_torchrun_failing_rank():
    out, elapsed = _torchrun("--fail-rank", "2")
    text = out.stdout + out.stderr
    lines = [l for l in text.splitlines() if l.startswith("rank ")]
    print(f"\n({elapsed:.1f} s)\n" + "\n".join(lines))
    assert out.returncode != 0 and elapsed < 120
    assert "rank 2 failed: RuntimeError: injected failure on rank 2" in text
    for r in (0, 1, 3):
        assert f"rank {r}: aborted because rank 2 failed: RuntimeError: injected failure" in text, text[-3000:]


def _store():
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))


def test_a_failed_rank_stays_until_the_others_have_settled():
    """The failed rank writes the abort and stays until every other rank has reported it or finished (a launcher
    like torchrun kills the rest as soon as one exits), and no longer than its bound when some never do."""
    import threading

    from megamoe.distributed import launch

    store = _store()

    def others():  # two ranks settle 1.0 s after the abort is written
        while not store.check([launch.ABORT_KEY]):
            time.sleep(0.01)
        time.sleep(1.0)
        for _ in range(2):
            store.add(launch.SETTLED_KEY, 1)

    threading.Thread(target=others, daemon=True).start()
    t0 = time.monotonic()
    launch._publish_failure(store, "rank 0 failed: RuntimeError: x", world_size=3, settle_s=8.0)
    assert 1.0 <= time.monotonic() - t0 < 6.0
    assert store.get(launch.ABORT_KEY).decode().startswith("rank 0 failed")

    store = _store()  # nobody settles: the bound
    t0 = time.monotonic()
    launch._publish_failure(store, "rank 1 failed: RuntimeError: y", world_size=3, settle_s=0.6)
    assert 0.6 <= time.monotonic() - t0 < 5.0

    store = _store()  # a rank whose failure is another's abort settles and writes no abort of its own
    launch._publish_failure(store, "rank 2: aborted because rank 0 failed: z\n(then, on this rank) ...", world_size=3)
    assert store.add(launch.SETTLED_KEY, 0) == 1 and not store.check([launch.ABORT_KEY])


def _rank_0_leaves(rank, world):
    if rank == 0:
        return "left"
    t = torch.ones(4)
    torch.distributed.all_reduce(t)
    return t


def test_a_rank_that_leaves_early_is_named_with_what_it_did():
    """Rank 0 returns while rank 1 waits in an all_reduce: rank 1 fails with its peer's socket error, and the
    launch names rank 0 as the one that left, first."""
    with pytest.raises(RankError) as info:
        spawn(_rank_0_leaves, 2, timeout_s=30, grace_s=2)
    msg = str(info.value)
    print(f"\n{msg}")
    assert info.value.first_rank == 1
    assert msg.splitlines()[0].startswith("distributed launch of 2 ranks failed: rank(s) [0] returned while")
    assert info.value.failures[0].startswith("rank 0: left early: its function returned after")
