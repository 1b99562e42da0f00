"""The ceilings every roofline here is drawn against, measured on the card in the same run.

    copy_gbps     device-to-device copy of a buffer far larger than L2; bytes read + bytes written
    fp8_tflops    torch._scaled_mm e4m3 x e4m3 -> bf16 at n^3 (8192^3 on a GPU) on random data
    bf16_tflops   torch.matmul bf16 at n^3
    ReadCeiling   the time of the fastest plain read of exactly N bytes megamoe can launch, timed like a kernel:
                  the size-aware ceiling. Per size it times each candidate (``default_candidates``: the CUDA read,
                  read_cuda.py, and Triton's persistent read, read_kernel.py, at 4-32 blocks per SM, and the old
                  streaming read) and keeps the fastest; the streaming read's time is kept beside it. Off CUDA a
                  torch reduction. At decode sizes a read of the experts' bytes cannot reach the copy bandwidth
                  (launch and ramp-up: on the H200 the streaming read of 80.2 MB took 28 us, 2.85 TB/s), so "of
                  floor" alone would flatter nobody and blame every kernel; "of read" says how close a backend gets
                  to what a read can do.

Datasheet rates are leads only: these are what the floors divide by. On a CPU every figure is measured too
(float32 matmul in place of FP8 when _scaled_mm is missing; ``notes`` says so).
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field

import torch

from ..provenance import device_name, resolve_device
from .timing import time_fn


@dataclass
class Ceilings:
    device: str
    copy_gbps: float  # GB/s = 1e9 bytes/s, read + written
    fp8_tflops: float
    bf16_tflops: float
    copy_bytes: int = 0
    matmul_n: int = 0
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Ceilings":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def measure_copy_gbps(device=None, nbytes: int | None = None, repeats: int = 10) -> tuple[float, int]:
    """Copy bandwidth in GB/s counting bytes read + bytes written, and the buffer size used."""
    dev = resolve_device(device)
    nbytes = nbytes or (2 * 2**30 if dev.type == "cuda" else 64 * 2**20)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), warmup=3, repeats=repeats, flush_l2=False, device=dev)
    return 2 * nbytes / (t.median_us * 1e-6) / 1e9, nbytes


def measure_fp8_tflops(device=None, n: int | None = None, repeats: int = 10) -> tuple[float, str]:
    """torch._scaled_mm (e4m3 x e4m3, per-tensor scale 1, bf16 out) at n^3 on random data. On a CPU n is 128:
    torch emulates FP8 there (512^3 took 6.6 s a call on 2 cores), and the figure only has to exist."""
    dev = resolve_device(device)
    n = n or (8192 if dev.type == "cuda" else 128)
    try:
        a = (torch.randn(n, n, device=dev) * 0.5).to(torch.float8_e4m3fn)
        b = (torch.randn(n, n, device=dev) * 0.5).to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt wants
        one = torch.ones((), device=dev, dtype=torch.float32)
        fn = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
        fn()
        how = "torch._scaled_mm e4m3"
    except Exception as exc:  # noqa: BLE001 - CPU builds may lack FP8 matmul
        a, b = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)
        fn = lambda: a @ b  # noqa: E731
        how = f"float32 matmul (no FP8 _scaled_mm here: {type(exc).__name__})"
    t = time_fn(fn, warmup=3, repeats=repeats, flush_l2=False, device=dev)
    return 2 * n**3 / (t.median_us * 1e-6) / 1e12, how


def measure_bf16_tflops(device=None, n: int | None = None, repeats: int = 10) -> float:
    dev = resolve_device(device)
    n = n or (8192 if dev.type == "cuda" else 512)
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    t = time_fn(lambda: a @ b, warmup=3, repeats=repeats, flush_l2=False, device=dev)
    return 2 * n**3 / (t.median_us * 1e-6) / 1e12


def measure_ceilings(device=None, *, copy_bytes: int | None = None, matmul_n: int | None = None,
                     repeats: int = 10) -> Ceilings:
    dev = resolve_device(device)
    copy, nbytes = measure_copy_gbps(dev, copy_bytes, repeats)
    fp8, how = measure_fp8_tflops(dev, matmul_n, repeats)
    bf16 = measure_bf16_tflops(dev, matmul_n, repeats)
    n = matmul_n or (8192 if dev.type == "cuda" else 512)
    n8 = matmul_n or (8192 if dev.type == "cuda" else 128)
    notes = [f"copy: {nbytes / 2**20:.0f} MiB device-to-device, bytes read + written",
             f"fp8: {how} at {n8}^3, random data", f"bf16: torch.matmul at {n}^3, random data"]
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return Ceilings(device_name(dev), copy, fp8, bf16, nbytes, n, notes)


STREAM = "triton-stream"  # the roofline's read until issue 47 (read_kernel.read_all), kept as a named candidate
BLOCKS_PER_SM = (4, 8, 16, 32)  # the persistent reads' grids: blocks (programs) per SM


@dataclass(frozen=True)
class ReadCandidate:
    """One way to read a buffer once. ``kernel``: "cuda" (read_cuda.read_cuda), "triton" (read_kernel's persistent
    read with load hint ``hint``), "triton-stream" (read_kernel.read_all) or "torch" (torch.sum, off CUDA);
    ``per_sm``: the persistent reads' blocks per SM. ``name`` is how results and the device script call it."""

    kernel: str
    per_sm: int = 0
    hint: str = "cg"

    @property
    def name(self) -> str:
        kernel = f"triton-{self.hint}" if self.kernel == "triton" else self.kernel
        return f"{kernel}/{self.per_sm}" if self.per_sm else kernel

    @classmethod
    def parse(cls, name: str) -> "ReadCandidate":
        """The candidate a ``name`` names ("cuda/16", "triton-cg/8", "triton-evict-first/4", "triton-stream")."""
        kernel, _, per_sm = name.partition("/")
        if kernel in (STREAM, "torch"):
            if per_sm:
                raise ValueError(f"read candidate {name!r}: {kernel} has no grid to size (no '/N')")
            return cls(kernel)
        if kernel == "cuda" or kernel.startswith("triton-"):
            if not per_sm.isdigit() or int(per_sm) < 1:
                raise ValueError(f"read candidate {name!r}: blocks per SM after '/' must be a positive integer")
            if kernel == "cuda":
                return cls("cuda", int(per_sm))
            from .read_kernel import HINTS

            if kernel[len("triton-"):] not in HINTS:
                raise ValueError(f"read candidate {name!r}: the Triton read's hint must be one of {sorted(HINTS)}")
            return cls("triton", int(per_sm), kernel[len("triton-"):])
        raise ValueError(f"read candidate {name!r}: expected cuda/N, triton-HINT/N, {STREAM} or torch")

    def prepare(self, buf: torch.Tensor, sms: int) -> tuple:
        """(call, out): a call that reads ``buf`` once, and the int32 tensor whose xor is what it read (None for
        torch, whose call returns an int64 sum)."""
        if self.kernel == "torch":
            return (lambda: torch.sum(buf, dtype=torch.int64)), None
        from . import read_kernel as rk

        if self.kernel == STREAM:
            out = torch.empty(rk.programs(buf), dtype=torch.int32, device=buf.device)
            rk.check_read_args(buf, out)
            return (lambda: rk.read_all(buf, out)), out
        if self.kernel == "triton":
            out = torch.empty(rk.grid_stride_programs(buf.numel(), self.per_sm, sms), dtype=torch.int32,
                              device=buf.device)
            rk.check_read_args(buf, out)
            return (lambda: rk.read_grid_stride(buf, out, self.hint)), out
        from .read_cuda import cuda_blocks, read_cuda

        out = torch.empty(cuda_blocks(buf.numel(), self.per_sm, sms), dtype=torch.int32, device=buf.device)
        return (lambda: read_cuda(buf, out)), out


def default_candidates(device=None) -> tuple[list[ReadCandidate], list[str]]:
    """The reads ``ReadCeiling`` tries on ``device`` and notes on what was left out and why: on CUDA the CUDA read
    and Triton's persistent read (load hint .cg) at ``BLOCKS_PER_SM``, and the streaming read; without nvcc (or
    when its build fails) the Triton reads alone; without Triton, or off CUDA, torch.sum."""
    dev = resolve_device(device)
    if dev.type != "cuda":
        return [ReadCandidate("torch")], ["no CUDA device: torch.sum over int32"]
    try:
        from . import read_kernel  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - the torch reduction reads the same bytes
        return [ReadCandidate("torch")], [f"torch.sum over int32: Triton unavailable: {type(exc).__name__}: {exc}"]
    cands = [ReadCandidate("triton", k) for k in BLOCKS_PER_SM] + [ReadCandidate(STREAM)]
    try:
        from .read_cuda import arch_of, library

        library(arch_of(dev))
        return [ReadCandidate("cuda", k) for k in BLOCKS_PER_SM] + cands, []
    except Exception as exc:  # noqa: BLE001 - no nvcc, or it failed: the Triton reads still stand
        return cands, [f"no CUDA read ({type(exc).__name__}: {str(exc).splitlines()[0]}): the Triton reads only"]


def xor_of(out: torch.Tensor | None) -> int | None:
    """The xor of a read's per-block outputs: the xor of every word it read (None for a torch read)."""
    if out is None:
        return None
    import numpy as np

    return int(np.bitwise_xor.reduce(out.cpu().numpy().astype(np.uint32), initial=np.uint32(0)))


class ReadCeiling:
    """``us(nbytes)``: the time of the fastest plain read of exactly ``nbytes`` (rounded up to 16 bytes) that
    megamoe can launch here, the L2 flushed between reads, measured once per size and kept: a ceiling is the best
    read one can measure. The buffer is random bytes (never zeros) and each read's result is kept.

    Per size, every candidate (``default_candidates``) reads the buffer once first: one whose xor of it differs
    from the streaming read's (or, without it, the first candidate's) is dropped with a warning (``rejected``: it
    skipped or repeated words), and so is one that raises (``failed``, with its error). The rest are timed for
    ``screen_s`` each (at least ``repeats`` calls), then the fastest and the streaming read for ``min_time_s``.
    ``record(nbytes)`` holds all of it: ``best`` (its name), ``us``, ``stream_us`` (the old read; None where it
    is not a candidate), ``screen_us`` per kept candidate. ``how`` names the candidates and any note."""

    def __init__(self, device=None, *, min_time_s: float = 0.1, screen_s: float = 0.02, repeats: int = 20,
                 warmup: int = 3, candidates: list[ReadCandidate] | None = None):
        self.dev = resolve_device(device)
        self.min_time_s, self.screen_s, self.repeats, self.warmup = min_time_s, screen_s, repeats, warmup
        if candidates is None:
            self.candidates, self.notes = default_candidates(self.dev)
        else:
            self.candidates, self.notes = list(candidates), []
        if not self.candidates:
            raise ValueError("candidates must name at least one read, got an empty list")
        self.sms = torch.cuda.get_device_properties(self.dev).multi_processor_count if self.dev.type == "cuda" else 1
        names = [c.name for c in self.candidates]
        self.how = (f"fastest of {len(names)} reads per size ({', '.join(names)}): 'read_kernel' in a row names it"
                    if len(names) > 1 else names[0]) + "".join(f"; {n}" for n in self.notes)
        self.cache: dict[int, dict] = {}  # rounded size -> record

    def _time(self, fn, seconds: float) -> float:
        """The median of one timed pass (L2 flushed between calls); on a CPU ``repeats`` calls, no minimum time."""
        seconds = seconds if self.dev.type == "cuda" else 0.0
        return time_fn(fn, warmup=self.warmup, repeats=self.repeats, device=self.dev, min_time_s=seconds).median_us

    def record(self, nbytes: float) -> dict:
        n = max(16, -(-int(nbytes) // 16) * 16)
        if n not in self.cache:
            gen = torch.Generator(device=self.dev).manual_seed(n)  # made on the device: up to ~7 GB at 8192 tokens
            buf = torch.randint(-2**31, 2**31 - 1, (n // 4,), dtype=torch.int32, generator=gen, device=self.dev)
            calls, xors, failed = {}, {}, {}
            for c in self.candidates:  # each read once, its result checked, before any is timed
                try:
                    fn, out = c.prepare(buf, self.sms)
                    fn()
                    xors[c.name], calls[c.name] = xor_of(out), fn
                except Exception as exc:  # noqa: BLE001 - a read that cannot launch here is left out, by name
                    failed[c.name] = f"{type(exc).__name__}: {exc}"
            if not calls:
                raise RuntimeError(f"no read could run at {n} bytes: {failed}")
            ref = STREAM if STREAM in xors else next((k for k, x in xors.items() if x is not None), None)
            want = xors[ref] if ref is not None else None
            rejected = sorted(k for k, x in xors.items() if want is not None and x is not None and x != want)
            if rejected or failed:  # a read that skips or repeats words must not set the ceiling, nor vanish unseen
                warnings.warn(f"read ceiling at {n} bytes: dropped {rejected} (read other words than {ref}) and "
                              f"{sorted(failed)} (failed: {failed})")
            kept = [k for k in calls if k not in rejected]
            screen = {k: self._time(calls[k], self.screen_s) for k in kept} if len(kept) > 1 else {}
            best = min(screen, key=screen.get) if screen else kept[0]
            final = {k: self._time(calls[k], self.min_time_s) for k in dict.fromkeys([best, STREAM]) if k in kept}
            self.cache[n] = {"bytes": n, "best": best, "us": final[best], "stream_us": final.get(STREAM),
                             "screen_us": screen, "rejected": rejected, "failed": failed, "xor": want}
            del calls, buf
        return self.cache[n]

    def us(self, nbytes: float) -> float:
        return self.record(nbytes)["us"]

    def summary(self) -> dict:
        """What a results file keeps: ``read`` (``how``), ``read_candidates`` (names) and ``read_sizes`` (every
        size measured so far, its record, by size)."""
        return {"read": self.how, "read_candidates": [c.name for c in self.candidates],
                "read_sizes": [self.cache[n] for n in sorted(self.cache)]}
