"""Results of ``megamoe bench`` as files and screen tables.

    results.json   everything (meta of each process, ceilings, every row with its samples, studies, errors)
    results.jsonl  one record per timed row (megamoe.bench.jsonl)
    results.md     the tables below in Markdown
    sweep.png      time vs tokens per backend, log-log, the floor and the read ceiling drawn (plots.py)
    block_m.png    every forced BLOCK_M vs tokens (when the study ran)
"""

from __future__ import annotations

import json
import math
import os

from rich.markup import escape

from ..tabular import markdown_table, show_table
from .tables import first_pass


def fmt_us(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def pct(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{100 * v:.0f}%" if abs(v) >= 0.095 else f"{100 * v:.2g}%"


md_table = markdown_table  # one Markdown writer for check.md and results.md (megamoe.tabular)


def on_gpu(results: dict) -> bool:
    """Whether the run's ceilings and floors were measured on a GPU. On a CPU, torch._scaled_mm is emulated: its
    'FP8 rate' is no hardware ceiling, and a floor bounded by it means nothing, so neither is shown."""
    return bool((results.get("meta") or {}).get("gpu"))


def ceilings_text(c: dict, gpu: bool) -> str:
    """'copy 3,350 GB/s, FP8 1,500 TFLOP/s, bf16 ...' on a GPU; on a CPU the copy bandwidth only."""
    def num(k):
        v = c.get(k)
        return "-" if v is None or v != v else f"{v:,.0f}"

    if not gpu:
        return f"copy {num('copy_gbps')} GB/s (no FP8 or bf16 ceiling on a CPU: no tensor cores to measure)"
    return f"copy {num('copy_gbps')} GB/s, FP8 {num('fp8_tflops')} TFLOP/s, bf16 {num('bf16_tflops')} TFLOP/s"


def empty_studies(results: dict) -> dict[str, str]:
    """{study: why it has no rows} for each study asked for that produced nothing and was not skipped by name."""
    asked = (results.get("meta") or {}).get("config", {}).get("studies") or []
    skipped = " ".join(results.get("skipped", {}))
    backends = results.get("backends", [])
    fused = [b for b in backends if b.get("fused")]
    device = [b for b in backends if not b.get("host_bound")]
    why = {
        "ragged": "no fused backend ran here (the ragged step times fused kernels, one rank at a time)" if not fused
        else "no fused backend takes the ragged steps' largest count",
        "overhead": "every backend here is host-bound (the harness overhead is measured on device-bound rows)"
        if not device else "no device-bound backend was timed at the overhead study's token counts",
        "staging": "no staging case ran",
        "block_m": "no backend here can force BLOCK_M",
    }
    return {s: why.get(s, "nothing to time") for s in asked
            if not results.get(s) and s not in skipped}


def backend_names(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["backend"] for r in rows))


def cell(r: dict, gpu: bool = True) -> str:
    """A row's figure: device-bound 'us (of floor, of read, BM n)' (no floor off a GPU: ``on_gpu``); host-bound
    'mean +- standard error'."""
    if r.get("statistic") == "mean" or r.get("host_bound"):
        return f"{fmt_us(r['us'])} +- {fmt_us(r.get('stderr_us'))}"
    parts = ([pct(r.get("frac_of_floor"))] if gpu else []) + ([f"read {pct(r['frac_of_read'])}"] if r.get("frac_of_read") else [])
    parts += [f"BM {r['block_m']}"] if r.get("block_m") else []
    return f"{fmt_us(r['us'])} ({', '.join(parts)})" + (" FAIL" if r.get("correct") is False else "")


def sweep_table(results: dict) -> tuple[list[str], list[list[str]]]:
    """One line per token count: the floor of the MXFP4 weights' step (and what bounds it: the copy bandwidth or
    the FP8 rate; GPU only) and a plain read of their bytes, each backend's figure, the speedups."""
    rows = first_pass(results["rows"])
    names = backend_names(rows)
    gpu = on_gpu(results)
    spd = {(s["tokens"], s["fused"]): s for s in results.get("speedup", [])}
    fused = [n for n in names if any(r["fused"] for r in rows if r["backend"] == n)]
    stream = any(r.get("read_us_stream") for r in rows)  # the streaming read (the ceiling until issue 47) beside
    head = (["tokens"] + (["floor us, MXFP4 weights (bound by)"] if gpu else []) + ["read us, MXFP4 bytes"]
            + (["streaming read us"] if stream else [])
            + [f"{n} us" for n in names]
            + [f"{f} vs unfused" for f in fused if any("speedup" in s for s in spd.values() if s["fused"] == f)])
    body = []
    for t in sorted({r["tokens"] for r in rows}):
        at = {r["backend"]: r for r in rows if r["tokens"] == t}
        mx = next((r for r in at.values() if r["weight_format"] == "mxfp4"), next(iter(at.values())))
        mxfp4 = mx["weight_format"] == "mxfp4"
        read = fmt_us(mx.get("read_us")) + (f" ({mx['read_kernel']})" if mx.get("read_kernel") else "")
        line = [str(t)] + ([f"{fmt_us(mx['floor_mxfp4_us'])} ({mx['bound']})"] if gpu else [])
        line += [read if mxfp4 else "-"]
        line += [fmt_us(mx.get("read_us_stream")) if mxfp4 else "-"] if stream else []
        line += [cell(at[n], gpu) if n in at else "-" for n in names]
        for f in fused:
            if len(head) > len(line):
                s = spd.get((t, f))
                line.append(f"{s['speedup']:.2f}x" if s and "speedup" in s else "-")
        body.append(line)
    return head, body


def detail_table(results: dict) -> tuple[list[str], list[list[str]]]:
    """Every first-pass row in full (the floor only where it was measured: a GPU)."""
    gpu = on_gpu(results)
    head = ["backend", "tokens", "BM", "timed by", "figure us", "stat", "spread", "calls", "kineto us", "TFLOP/s",
            "GB/s", "floor us", "of floor", "read us", "of read", "calc_diff", "pass 2 us", "repeat spread"]
    rep = {(r["backend"], r["tokens"]): r for r in results.get("repeatability", [])}
    body = []
    for r in first_pass(results["rows"]):
        rp = rep.get((r["backend"], r["tokens"]))
        stat = r.get("statistic", "median") + (f" +- {fmt_us(r.get('stderr_us'))}" if r.get("statistic") == "mean" else "")
        body.append([r["backend"], str(r["tokens"]), str(r.get("block_m") or "-"), str(r.get("path", r["method"])),
                     fmt_us(r["us"]), stat, pct(r["spread"]), str(r["repeats"]), fmt_us(r.get("kineto_us")),
                     f"{r['tflops']:.3g}", f"{r['gbps']:.4g}", fmt_us(r["floor_us"]) if gpu else "-",
                     pct(r["frac_of_floor"]) if gpu else "-",
                     fmt_us(r.get("read_us")), pct(r.get("frac_of_read")),
                     f"{r['calc_diff']:.1e}" if r.get("calc_diff") is not None else "-",
                     fmt_us(rp["medians_us"][1]) if rp else "-",
                     (f"{100 * rp['spread']:.2f}%" + (" (over)" if rp["flag"] else "")) if rp else "-"])
    return head, body


def header(results: dict) -> list[str]:
    procs = results.get("processes") or [results["meta"]]
    m = procs[0]
    out = [f"# megamoe bench: {m.get('geometry', {}).get('name', '')} on {m['card']}", ""]
    for p in procs:
        n = f"process {p.get('process', 1)}: " if len(procs) > 1 else ""
        c = p.get("ceilings") or results.get("ceilings") or {}
        out.append(f"- {n}{p['date']}, commit `{p['commit']}`{' (dirty tree)' if p.get('dirty') else ''}; "
                   + ", ".join(f"{k} {v}" for k, v in p.get("versions", {}).items()))
        for prov in (p.get("kernel_modules") or {}).values():
            build = (prov.get("build") or {}).get("source")
            out.append(f"  - {prov['module']} {prov.get('version') or '?'} from {prov.get('file')}"
                       + (f" ({build})" if build else ""))
        if c:
            out.append(f"  - ceilings: {ceilings_text(c, bool(p.get('gpu')))}; copy = bytes read + written; read "
                       f"ceiling: {c.get('read') or 'not measured'}")
    if m.get("gpu"):
        out.append("- card: " + ", ".join(f"{k} {v}" for k, v in m["gpu"].items() if v))
    cfg = m.get("config", {})
    rows = results.get("rows", [])
    if any(not r.get("host_bound") for r in rows):  # the device-bound sentence only where there are such rows
        out.append(f"- device-bound rows: median of >= {cfg.get('rep_ms')} ms of calls (at least {cfg.get('repeats')}) "
                   f"after >= {cfg.get('warmup_ms')} ms of warm-up, L2 flushed (fused) or {cfg.get('rotate')} input sets "
                   f"rotated; {cfg.get('passes')} passes, the repeatability bar 3%")
    if any(r.get("host_bound") for r in rows):
        out.append(f"- host-bound rows (+-): mean +- standard error over {cfg.get('rep_ms')} ms of calls (at least "
                   f"{min(r.get('repeats', 0) for r in rows if r.get('host_bound'))}), one pass, host wall time")
    out.append(f"- wall time {results.get('wall_seconds', '?')} s")
    if on_gpu(results):
        out.append("- 'of floor' = floor / time, floor = max(bytes of the experts touched + activations over copy "
                   "bandwidth, FLOPs over the FP8 rate), each backend with its own weight format")
    out.append("- 'read' = the fastest plain read of the same bytes / time (1.0 = as fast as reading them; the read "
               "kernel that was fastest in brackets)")
    return out


def to_markdown(results: dict) -> str:
    out = header(results)
    if results["rows"]:
        out += ["", "## Sweep", "", md_table(*sweep_table(results))]
        procs = sorted({r.get("process", 1) for r in results["rows"]})
        if len(procs) > 1:  # which process timed which backend (a later reading of one already timed: "[pN]")
            out += ["", "; ".join(f"process {p}: " + ", ".join(backend_names([r for r in results["rows"]
                                                                             if r.get("process", 1) == p]))
                                  for p in procs) + "."]
        out += ["", "## Every row", "", md_table(*detail_table(results))]
    rep = results.get("repeatability", [])
    if rep:
        worst = max(rep, key=lambda r: r["spread"] if r["spread"] == r["spread"] else float("inf"))
        flagged = [r for r in rep if r["flag"]]
        out += ["", "## Repeatability (device-bound rows)", "",
                f"Largest per-row spread {100 * worst['spread']:.2f}% ({worst['backend']} at {worst['tokens']} tokens); "
                f"{len(flagged)} of {len(rep)} rows at or over 3%."]
        if flagged:
            out += ["", md_table(["backend", "tokens", "pass medians us", "spread"],
                                 [[r["backend"], str(r["tokens"]), ", ".join(fmt_us(x) for x in r["medians_us"]),
                                   f"{100 * r['spread']:.2f}%"] for r in flagged])]
    if results.get("drift"):
        out += ["", "Drift (each backend's first case timed again after the sweep):", "",
                md_table(["backend", "tokens", "start us", "end us", "change"],
                         [[d["backend"], str(d["tokens"]), fmt_us(d["start_us"]), fmt_us(d["end_us"]),
                           f"{100 * d['change']:+.2f}%" + (" OVER" if d["flag"] else "")] for d in results["drift"]])]
    if results.get("cross_process"):
        out += ["", "## One backend in two processes (same card)", "",
                md_table(["backend", "tokens", "us per process", "change"],
                         [[x["backend"], str(x["tokens"]), " / ".join(fmt_us(u) for u in x["us"]),
                           f"{100 * x['change']:+.2f}%"] for x in results["cross_process"]])]
    if results.get("block_m_best"):
        bms = sorted({int(k) for r in results["block_m_best"] for k in r["times_us"]})
        out += ["", "## BLOCK_M study (every forced BLOCK_M)", "", md_table(
            ["backend", "tokens", "plan BM", "plan us"] + [f"BM {b} us" for b in bms] + ["best BM", "plan / best"],
            [[r["backend"], str(r["tokens"]), str(r["plan_block_m"]), fmt_us(r["plan_us"])]
             + [fmt_us(r["times_us"].get(b, r["times_us"].get(str(b)))) for b in bms]
             + [str(r["best_block_m"]) if r["best_block_m"] is not None
                else "- (BM " + ", ".join(map(str, r["missing"])) + " not timed)",
                f"{r['plan_over_best']:.3f}" if r["plan_over_best"] else "-"] for r in results["block_m_best"]])]
    if results.get("ragged"):
        out += ["", "## Ragged step (each rank timed alone on one GPU)", "", md_table(
            ["backend", "mean", "rank counts", "agreed", "own BMs", "agreed BM", "step own us", "step padded us", "padding cost"],
            [[r["backend"], str(r["mean_tokens"]), str(r["counts"]), str(r["agreed"]),
              str([x["own_block_m"] for x in r["ranks"]]), str(r["ranks"][0]["agreed_block_m"]),
              fmt_us(r["step_own_us"]), fmt_us(r["step_padded_us"]), pct(r["padding_cost"])] for r in results["ragged"]])]
    if results.get("staging"):
        keys = sorted({k for r in results["staging"] for k in r if k.startswith("frac_of ")})
        out += ["", "## Staging cost", "", md_table(
            ["what", "tokens", "us"] + [k.replace("frac_of ", "of ") for k in keys],
            [[r["what"], str(r["tokens"]), fmt_us(r["median_us"])] + [pct(r.get(k)) for k in keys] for r in results["staging"]])]
    if results.get("overhead"):
        out += ["", "## Harness overhead", "", f"Compared: {results['overhead'][0].get('compared')}.", "", md_table(
            ["backend", "tokens", "timed by", "input sets", "bare loop us", "harness us", "harness / bare", "within 2%"],
            [[r["backend"], str(r["tokens"]), r.get("path", "-"), str(r.get("sets", 1)), fmt_us(r["bare_loop_us"]),
              fmt_us(r["harness_us"]), f"{r['ratio']:.4f}", "yes" if r["ok"] else "NO"] for r in results["overhead"]])]
    if not results["rows"]:
        out += ["", "No rows: nothing was timed (see Skipped and Errors)."]
    if results.get("skipped") or empty_studies(results):
        out += ["", "## Skipped", ""] + [f"- {k}: {v}" for k, v in results["skipped"].items()]
        out += [f"- study {k}: {v}" for k, v in empty_studies(results).items()]
    if results.get("errors"):
        out += ["", "## Errors", ""] + [f"- {e['where']}: {e['error']}" for e in results["errors"]]
    return "\n".join(out) + "\n"


def write_all(results: dict, out_dir: str, plots: bool = True) -> list[str]:
    """results.json (written whole, then moved into place), results.jsonl (a record per timed row:
    ``megamoe.bench.jsonl``), results.md, and the plots when ``plots`` (the end of the sweep or of the run).
    results.jsonl and results.md wait for the first row or the end: a run stopped before it times anything leaves
    results.json (its ceilings and setup), never a results.md of headers without rows."""
    os.makedirs(out_dir, exist_ok=True)
    p = os.path.join(out_dir, "results.json")
    with open(p + ".tmp", "w") as f:
        json.dump(results, f, indent=1, default=repr)
    os.replace(p + ".tmp", p)
    from .jsonl import write_jsonl

    written = [p]
    if results["rows"] or plots:  # like results.md: no baseline file of no rows
        written.append(write_jsonl(results, out_dir))
        written.append(os.path.join(out_dir, "results.md"))
        with open(written[-1] + ".tmp", "w") as f:
            f.write(to_markdown(results))
        os.replace(written[-1] + ".tmp", written[-1])
    if plots:
        from .plots import write_plots

        written += write_plots(results, out_dir)
    return written


def print_tables(results: dict, console=None) -> None:
    """The sweep table and the one-line verdicts (repeatability, overhead, cross-process, empty studies, errors) on
    screen: the table boxed where it fits, else in Markdown (``megamoe.tabular.show_table``)."""
    from rich.console import Console

    console = console or Console()
    c, m = results.get("ceilings") or {}, results["meta"]
    console.print(f"{m['card']} {m['date']} commit {m['commit']}; ceilings: {ceilings_text(c, on_gpu(results))}",
                  markup=False, highlight=False)
    if results["rows"]:
        head, body = sweep_table(results)
        hosts = any(r.get("host_bound") for r in results["rows"])
        title = ("time per layer, us (of floor, of the fastest read, BLOCK_M)" if on_gpu(results) else
                 "time per layer, us") + ("; host-bound rows: mean +- s.e." if hosts else "")
        show_table(console, title, head, body, justify="r")
    else:
        console.print("no rows: nothing was timed", markup=False)
    rep = results.get("repeatability", [])
    if rep:
        flagged = [r for r in rep if r["flag"]]
        console.print(f"repeatability (device-bound rows): largest spread {100 * max(r['spread'] for r in rep):.2f}%; "
                      f"{len(flagged)} of {len(rep)} rows at or over 3%"
                      + "".join(f"\n  {r['backend']} T={r['tokens']}: {100 * r['spread']:.2f}%" for r in flagged),
                      markup=False)
    for r in results.get("overhead", []):
        console.print(f"overhead {r['backend']} T={r['tokens']}: harness / bare loop {r['ratio']:.4f} "
                      f"({'ok' if r['ok'] else 'OVER 2%'})", markup=False)
    for x in results.get("cross_process", []):
        console.print(f"{x['backend']} T={x['tokens']} in processes {x['processes']}: "
                      f"{' / '.join(fmt_us(u) for u in x['us'])} us ({100 * x['change']:+.2f}%)", markup=False)
    skipped = {**results.get("skipped", {}), **{f"study {k}": v for k, v in empty_studies(results).items()}}
    for k, v in skipped.items():
        console.print(f"[yellow]skipped[/] {escape(k)}: {escape(str(v))}")
    for e in results.get("errors", []):
        console.print(f"[red]error[/] {escape(e['where'])}: {escape(str(e['error']))}")
