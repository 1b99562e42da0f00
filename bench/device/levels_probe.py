"""Long continuous timing traces of a few sweep rows, to find where the ~1 s "levels" come from.

The sweep's passes (about 1 s of samples each) disagree by more than 3% on a few rows: the eager
reference at 2-256 tokens and FlashInfer at 64 / 1024 tokens (runs 4272e3d00b and ff478e511e). This
script records one long trace per row instead, every call with its host timestamp, so that protocols
(pass length, warm-up, interleaving) can be compared offline on the same data without more device time.

Beside each reference call it times a fixed piece of pure-Python work on the same (pinned) CPU: if
the host's speed moves in levels, that probe moves with the reference. It also reads the pinned CPU's
steal and frequency (when the VM exposes them) and, per batch, the SM clock from NVML (when pynvml exists).

Usage (H200): python3 bench/device/levels_probe.py --out $OUT/levels.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from megamoe.bench.sweep import Sweep, SweepConfig, pin_timing_thread
from megamoe.bench.timing import L2Flusher, SpinAhead, _timed_batch, gc_paused
from megamoe.bench.timing import host_speed_probe_us as cpu_probe_us  # the same work the sweep probes


def cpu_stat(cpu: int) -> dict:
    out = {}
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith(f"cpu{cpu} "):
                    v = [int(x) for x in line.split()[1:]]
                    out["user"], out["system"], out["idle"], out["steal"] = v[0], v[2], v[3], v[7]
    except OSError:
        pass
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_cur_freq") as f:
            out["khz"] = int(f.read())
    except OSError:
        pass
    return out


def nvml_handle():
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return lambda: (pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                        pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0)
    except Exception:  # noqa: BLE001 - diagnostics only
        return None


def trace_device(fn, seconds: float, flush: L2Flusher, nvml) -> dict:
    """time_fn's instrument (spin ahead, flush, one event pair per call, batches of 10) run for
    ``seconds`` without stopping; every sample kept with its batch's end time."""
    spin = SpinAhead()
    t0 = time.perf_counter()
    samples, stamps, clocks = [], [], []
    with gc_paused(True):
        while time.perf_counter() - t0 < seconds:
            s = _timed_batch(lambda i: fn(), range(10), spin, flush)
            now = time.perf_counter() - t0
            samples += s
            stamps += [now] * len(s)
            if nvml is not None:
                clocks.append((now, *nvml()))
    return {"samples_us": [round(x, 2) for x in samples], "t_s": [round(x, 4) for x in stamps], "nvml": clocks}


def trace_host(fn, args, seconds: float, cpu: int) -> dict:
    """One reference call at a time (event pair + wall clock), each followed by the CPU probe."""
    samples, wall, probe, stamps, stat = [], [], [], [], []
    t0 = time.perf_counter()
    i = 0
    next_stat = 0.0
    with gc_paused(True):
        while time.perf_counter() - t0 < seconds:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            w0 = time.perf_counter()
            a.record()
            fn(args[i % len(args)])
            b.record()
            torch.cuda.synchronize()
            w1 = time.perf_counter()
            samples.append(a.elapsed_time(b) * 1e3)
            wall.append((w1 - w0) * 1e6)
            probe.append(cpu_probe_us())
            stamps.append(w1 - t0)
            if w1 - t0 >= next_stat:
                stat.append((round(w1 - t0, 3), cpu_stat(cpu)))
                next_stat += 0.5
            i += 1
    return {"samples_us": [round(x, 1) for x in samples], "wall_us": [round(x, 1) for x in wall],
            "probe_us": [round(x, 1) for x in probe], "t_s": [round(x, 4) for x in stamps], "cpu_stat": stat}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device-seconds", type=float, default=8.0)
    ap.add_argument("--host-seconds", type=float, default=25.0)
    ap.add_argument("--probe-seconds", type=float, default=10.0)
    args = ap.parse_args()
    cfg = SweepConfig(tokens=[2, 32, 64, 1024], block_m_study=False, ragged=False, staging=False, overhead=False,
                      progress=False)
    sw = Sweep(cfg)
    sw.section_ceilings()
    sw.section_setup()
    pinned = pin_timing_thread()
    cpu = pinned.get("cpu", 0)
    doc = {"meta": sw.meta, "pinned": pinned, "nproc": os.cpu_count(), "traces": []}
    try:
        with open("/proc/cpuinfo") as f:
            doc["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass

    def save():
        with open(args.out, "w") as f:
            json.dump(doc, f)

    # 1. the host alone: the probe back to back (no GPU work), with steal / frequency every 0.5 s
    t0, probe, stamps, stat = time.perf_counter(), [], [], []
    while time.perf_counter() - t0 < args.probe_seconds:
        probe.append(cpu_probe_us())
        stamps.append(time.perf_counter() - t0)
        if len(probe) % 1000 == 1:
            stat.append((round(stamps[-1], 3), cpu_stat(cpu)))
    doc["traces"].append({"what": "cpu probe alone", "probe_us": [round(x, 1) for x in probe],
                          "t_s": [round(x, 4) for x in stamps], "cpu_stat": stat})
    save()
    print(f"[levels] cpu probe: {len(probe)} calls", flush=True)
    nvml = nvml_handle()
    flush = L2Flusher(sw.dev)
    for b in sw.backends:
        if b.name.startswith("reference"):
            continue
        for t in (64, 1024):
            try:
                fn, _ = b.timer([sw.inputs(t)])
                torch.cuda.synchronize()
                time.sleep(2.0)
                tr = trace_device(fn, args.device_seconds, flush, nvml)
                doc["traces"].append({"what": b.name, "tokens": t, **tr})
                print(f"[levels] {b.name} T={t}: {len(tr['samples_us'])} calls", flush=True)
            except Exception as exc:  # noqa: BLE001
                doc["traces"].append({"what": b.name, "tokens": t, "error": repr(exc)})
            save()
    ref = next(b for b in sw.backends if b.name.startswith("reference"))
    for t in (2, 32):
        fn, sets = ref.timer([sw.inputs(t, k) for k in range(cfg.rotate)])
        torch.cuda.synchronize()
        time.sleep(2.0)
        tr = trace_host(fn, sets, args.host_seconds, cpu)
        doc["traces"].append({"what": ref.name, "tokens": t, **tr})
        print(f"[levels] reference T={t}: {len(tr['samples_us'])} calls", flush=True)
        save()


if __name__ == "__main__":
    main()
