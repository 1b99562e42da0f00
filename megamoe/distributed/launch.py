"""Start R ranks on this host (127.0.0.1 only), or join the ones ``torchrun`` started, with failures
that describe themselves instead of hangs.

    spawn(fn, nprocs)        the library's own launcher: fn(rank, world_size, *args) on every rank,
                             returns [fn's result per rank], raises RankError naming each rank's fate
    init_from_env()          inside a ``torchrun`` worker: join the group from RANK / WORLD_SIZE / ...
    guarded(fn, ...)         run fn on this rank; if it raises, tell every other rank through the store

Failure protocol: a rank that raises writes ``megamoe/abort`` into the rendezvous store; a watchdog
thread on every rank polls that key and, when it appears, reports "aborted because rank r failed: ..."
and exits, so ranks blocked in a collective do not wait for the collective's own timeout. Every rank
counts itself in ``megamoe/settled`` once it will say nothing more (it reported the abort, or finished),
and the failed rank stays until all the others have (at most ``SETTLE_S``): a launcher such as
``torchrun`` that kills the remaining ranks as soon as one exits then cannot cut their reports short. The
launcher bounds the whole run by ``timeout_s`` and kills stragglers; the process-group timeout is the
second bound (collectives raise after it).
"""

from __future__ import annotations

import datetime
import io
import os
import queue as queue_mod
import re
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LOOPBACK = "127.0.0.1"
ABORT_KEY = "megamoe/abort"
SETTLED_KEY = "megamoe/settled"  # ranks that reported the abort or finished
SETTLE_S = 10.0  # how long a failed rank waits for the others to settle before it exits


# What a collective says when a peer's process is gone (gloo, NCCL, the store): the symptom of a rank that left.
PEER_GONE = re.compile(r"closed by peer|reset by peer|[Bb]roken pipe|Connection refused|remote process|"
                       r"peer process|socket", re.S)


class RankError(RuntimeError):
    """One or more ranks failed. ``failures`` maps rank -> its report (message + traceback)."""

    def __init__(self, message: str, failures: dict[int, str], first_rank: int | None):
        super().__init__(message)
        self.failures = failures
        self.first_rank = first_rank


class LaunchTimeout(RankError):
    """The launch ran past its timeout; the ranks still running were killed."""


@dataclass
class _Report:
    rank: int
    kind: str  # "ok" | "error" | "aborted"
    payload: bytes = b""
    message: str = ""
    extra: dict = field(default_factory=dict)
    at_s: float | None = None  # when the launcher received it, seconds after the start


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(b: bytes) -> Any:
    return torch.load(io.BytesIO(b), weights_only=False)


def _set_loopback_env(rank: int, world_size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo binds the loopback interface only


# ------------------------------------------------------------------------------ failure protocol
def _describe_failure(rank: int, exc: BaseException) -> str:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return f"rank {rank} failed: {type(exc).__name__}: {exc}\n{tb}"


def _abort_line(report: str) -> str:
    """The failed rank's report without its traceback (its message may span lines: keep them all)."""
    if not report:
        return "unknown failure"
    return report.split("\nTraceback (most recent call last):")[0].rstrip()


def _start_watchdog(store: dist.Store, rank: int, on_abort: Callable[[str], None], poll_s: float = 0.1) -> threading.Event:
    """Poll the store for the abort key; call on_abort(report of the failed rank) once. Returns a stop event."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(poll_s):
            try:
                if store.check([ABORT_KEY]):
                    report = store.get(ABORT_KEY).decode(errors="replace")
                    if not stop.is_set() and not report.startswith(f"rank {rank} "):
                        on_abort(report)
                    return
            except Exception:  # store gone: the launcher is tearing everything down
                return

    threading.Thread(target=watch, daemon=True, name=f"megamoe-watchdog-{rank}").start()
    return stop


def _failure_report(store: dist.Store | None, rank: int, exc: BaseException) -> str:
    """This rank's failure; if another rank failed first, this error is a consequence (a peer of a
    collective went away) and the report names the root cause first."""
    report = _describe_failure(rank, exc)
    try:
        if store is not None and store.check([ABORT_KEY]):
            first = store.get(ABORT_KEY).decode(errors="replace")
            if not first.startswith(f"rank {rank} "):
                return f"rank {rank}: aborted because {_abort_line(first)}\n(then, on this rank) {report}"
    except Exception:
        pass
    return report


def _settle(store: dist.Store | None) -> None:
    """Count this rank in: it has said all it will (its abort report, or its result)."""
    try:
        if store is not None:
            store.add(SETTLED_KEY, 1)
    except Exception:  # store gone: the launcher is tearing everything down
        pass


def _publish_failure(store: dist.Store | None, report: str, world_size: int, settle_s: float = SETTLE_S) -> None:
    """Write the report under the abort key (first writer wins), then stay until every other rank has
    settled (its watchdog reported the abort, or it finished), at most ``settle_s``. A rank whose own
    report is an abort (another rank failed first) settles instead."""
    if store is None:
        return
    if " aborted because " in report.splitlines()[0]:
        _settle(store)
        return
    try:
        if store.check([ABORT_KEY]):
            return
        store.set(ABORT_KEY, report)
        deadline = time.monotonic() + settle_s
        while store.add(SETTLED_KEY, 0) < world_size - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:
        pass


def guarded(fn: Callable[..., Any], rank: int, world_size: int, *args, store: dist.Store | None = None) -> Any:
    """Run fn(rank, world_size, *args) on this rank under the failure protocol (torchrun workers).

    If fn raises, the abort key is written (so every other rank stops within ~0.1 s) and the
    exception propagates. If another rank fails first, this rank prints the failure and exits 1.
    """
    store = store if store is not None else dist.distributed_c10d._get_default_store()

    def on_abort(report: str) -> None:
        print(f"rank {rank}: aborted because {_abort_line(report)}", file=sys.stderr, flush=True)
        _settle(store)
        os._exit(1)

    stop = _start_watchdog(store, rank, on_abort)
    try:
        out = fn(rank, world_size, *args)
        stop.set()
        _settle(store)
        return out
    except BaseException as exc:
        stop.set()
        report = _failure_report(store, rank, exc)
        print(report, file=sys.stderr, flush=True)
        _publish_failure(store, report, world_size)
        raise
    finally:
        stop.set()


def init_from_env(backend: str | None = None, timeout_s: float = 60.0) -> tuple[int, int]:
    """Join the process group ``torchrun`` set up (env:// rendezvous). Returns (rank, world_size).

    backend defaults to NCCL when CUDA is available, else gloo. NCCL ranks bind cuda:LOCAL_RANK.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("init_from_env: RANK / WORLD_SIZE are not set; start this under torchrun "
                           "or use megamoe.distributed.spawn")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if not dist.is_initialized():
        kwargs = {}
        if backend == "nccl":
            local = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local)
            kwargs["device_id"] = torch.device("cuda", local)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return dist.get_rank(), dist.get_world_size()


# ------------------------------------------------------------------------------ the launcher
def _worker(rank, world_size, port, backend, timeout_s, threads, fn, args, reports) -> None:
    _set_loopback_env(rank, world_size, port)
    if threads:
        torch.set_num_threads(threads)
    done = threading.Event()

    def send(rep: _Report) -> None:
        reports.put(rep)

    watch_store = None

    def on_abort(report: str) -> None:
        if done.is_set():
            return
        send(_Report(rank, "aborted", message=f"rank {rank}: aborted because {_abort_line(report)}"))
        reports.close()
        reports.join_thread()
        _settle(watch_store)
        os._exit(3)

    store = None
    try:
        td = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(LOOPBACK, port, world_size, is_master=False, timeout=td)
        watch_store = dist.TCPStore(LOOPBACK, port, world_size, is_master=False, timeout=td)
        stop = _start_watchdog(watch_store, rank, on_abort)
        kwargs = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            kwargs["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=td, **kwargs)
        out = fn(rank, world_size, *args)
        done.set()
        stop.set()
        send(_Report(rank, "ok", payload=_dumps(out)))
        _settle(store)
    except BaseException as exc:
        done.set()
        report = _failure_report(store, rank, exc)
        send(_Report(rank, "error", message=report, extra={"type": type(exc).__name__, "text": str(exc)}))
        _publish_failure(store, report, world_size)
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        reports.close()
        reports.join_thread()


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    *,
    args: tuple = (),
    backend: str = "gloo",
    timeout_s: float = 120.0,
    grace_s: float = 5.0,
    threads_per_rank: int | None = None,
    start_method: str = "spawn",
) -> list[Any]:
    """Run fn(rank, nprocs, *args) on ``nprocs`` fresh processes joined in one process group.

    fn must be importable (a module-level function); args and return values are pickled. The
    rendezvous store listens on 127.0.0.1 at a port the OS picks (no race for a free port).

    Returns the per-rank results, rank order. Raises RankError if any rank raised (its rank, type,
    message and traceback first, then what became of every other rank), LaunchTimeout if the whole
    run took longer than timeout_s (stragglers are killed; nothing is left running).
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < nprocs:
        raise RuntimeError(f"backend 'nccl' needs one GPU per rank: nprocs={nprocs}, "
                           f"torch.cuda.device_count()={torch.cuda.device_count()}")
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // nprocs)
    ctx = mp.get_context(start_method)
    master = dist.TCPStore(LOOPBACK, 0, nprocs, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=timeout_s))
    reports = ctx.Queue()
    procs = [ctx.Process(target=_worker, name=f"megamoe-rank-{r}", daemon=True,
                         args=(r, nprocs, master.port, backend, timeout_s, threads_per_rank, fn, args, reports))
             for r in range(nprocs)]
    start = time.monotonic()
    for p in procs:
        p.start()
    got: dict[int, _Report] = {}
    deadline = start + timeout_s
    first_fail: int | None = None
    try:
        while len(got) < nprocs:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                rep = reports.get(timeout=min(0.2, max(deadline - now, 0.01)))
                rep.at_s = time.monotonic() - start
                got[rep.rank] = rep
                if rep.kind == "error" and first_fail is None:
                    first_fail = rep.rank
                    deadline = min(deadline, time.monotonic() + grace_s)
                continue
            except queue_mod.Empty:
                pass
            for r, p in enumerate(procs):  # died without a report (segfault, os._exit, OOM kill)
                if r not in got and p.exitcode is not None and not p.is_alive():
                    try:  # a report may still be in flight
                        rep = reports.get(timeout=0.5)
                        got[rep.rank] = rep
                        continue
                    except queue_mod.Empty:
                        pass
                    if r not in got:
                        got[r] = _Report(r, "error", message=f"rank {r} died with exit code {p.exitcode} without a report")
                        if first_fail is None:
                            first_fail = r
                            deadline = min(deadline, time.monotonic() + grace_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        del master
    elapsed = time.monotonic() - start
    if len(got) == nprocs and all(rep.kind == "ok" for rep in got.values()):
        return [_loads(got[r].payload) for r in range(nprocs)]
    failures: dict[int, str] = {}
    for r in range(nprocs):
        rep = got.get(r)
        if rep is None:
            failures[r] = (f"rank {r}: still running after {elapsed:.1f} s; killed"
                           + (f" after rank {first_fail} failed" if first_fail is not None else ""))
        elif rep.kind != "ok":
            failures[r] = rep.message
    if first_fail is None and any(r not in got for r in range(nprocs)):
        lines = [f"distributed launch of {nprocs} ranks timed out after {timeout_s:.0f} s"]
        lines += [failures[r].splitlines()[0] for r in sorted(failures)]
        raise LaunchTimeout("\n".join(lines), failures, None)
    # A rank that returned while others still ran: the others' errors are the symptom (a peer's closed socket), so
    # the rank that left is named first, with what it did.
    fail_at = got[first_fail].at_s if first_fail in got else None
    peer_gone = bool(PEER_GONE.search(failures.get(first_fail, "")))
    left = [r for r in range(nprocs) if peer_gone and r in got and got[r].kind == "ok" and fail_at is not None
            and got[r].at_s is not None and got[r].at_s <= fail_at]
    for r in left:
        failures[r] = (f"rank {r}: left early: its function returned after {got[r].at_s:.1f} s while rank "
                       f"{first_fail} was still running (it failed at {fail_at:.1f} s); a rank that returns before "
                       "the others' collectives end makes them fail with the peer's socket error")
    # The first failure in full (with traceback), then one line for every other rank.
    lines = [f"distributed launch of {nprocs} ranks failed; first failure:", failures[first_fail], "every rank:"]
    if left:
        lines = [f"distributed launch of {nprocs} ranks failed: rank(s) {left} returned while the others still "
                 "ran collectives;", failures[left[0]], f"then rank {first_fail} failed:", failures[first_fail],
                 "every rank:"]
    lines += [f"  {failures[r].splitlines()[0]}" if r in failures else f"  rank {r}: finished" for r in range(nprocs)]
    raise RankError("\n".join(lines), failures, first_fail)
