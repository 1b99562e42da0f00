"""The ceilings every roofline here is drawn against, measured on the card in the same run.

    copy_gbps     device-to-device copy of a buffer far larger than L2; bytes read + bytes written
    fp8_tflops    torch._scaled_mm e4m3 x e4m3 -> bf16 at n^3 (8192^3 on a GPU) on random data
    bf16_tflops   torch.matmul bf16 at n^3
    ReadCeiling   the time of a plain read of exactly N bytes (a Triton streaming kernel on CUDA, a torch
                  reduction elsewhere), timed like a kernel: the size-aware ceiling. At decode sizes a read
                  of the experts' bytes cannot reach the copy bandwidth (launch and ramp-up: on the H200 a
                  plain read of 80.2 MB took 28 us, 2.85 TB/s), so "of floor" alone would flatter nobody
                  and blame every kernel; "of read" says how close a backend gets to what a read can do.

Datasheet rates are leads only: these are what the floors divide by. On a CPU every figure is measured too
(float32 matmul in place of FP8 when _scaled_mm is missing; ``notes`` says so).
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field

import torch

from .timing import resolve_device, time_fn


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


def device_name(device=None) -> str:
    dev = resolve_device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"cpu ({platform.processor() or platform.machine()})"


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


class ReadCeiling:
    """``us(nbytes)``: the median time of one plain read of exactly ``nbytes`` (rounded up to 16 bytes), the
    L2 flushed between reads, measured once per size and kept. The buffer is random bytes (never zeros) and
    the read's result is kept, so nothing is skipped. ``how`` names the kernel."""

    def __init__(self, device=None, *, min_time_s: float = 0.1, repeats: int = 20):
        self.dev = resolve_device(device)
        self.min_time_s, self.repeats = min_time_s, repeats
        self.cache: dict[int, float] = {}
        self.how = "torch.sum over int32 (no Triton on this device)"
        self._triton = None
        if self.dev.type == "cuda":
            try:
                from .read_kernel import read_all

                self._triton, self.how = read_all, "Triton streaming read (megamoe.bench.read_kernel)"
            except Exception as exc:  # noqa: BLE001 - the torch reduction reads the same bytes
                self.how += f"; Triton unavailable: {type(exc).__name__}: {exc}"

    def us(self, nbytes: float) -> float:
        n = max(16, -(-int(nbytes) // 16) * 16)
        if n not in self.cache:
            gen = torch.Generator(device=self.dev).manual_seed(n)  # made on the device: up to ~7 GB at 8192 tokens
            buf = torch.randint(-2**31, 2**31 - 1, (n // 4,), dtype=torch.int32, generator=gen, device=self.dev)
            if self._triton is not None:
                out = torch.empty(self._triton.programs(buf), dtype=torch.int32, device=self.dev)
                fn = lambda: self._triton(buf, out)  # noqa: E731
            else:
                fn = lambda: torch.sum(buf, dtype=torch.int64)  # noqa: E731
            t = time_fn(fn, warmup=3, repeats=self.repeats, device=self.dev,
                        min_time_s=self.min_time_s if self.dev.type == "cuda" else 0.0)
            self.cache[n] = t.median_us
            del buf
        return self.cache[n]
