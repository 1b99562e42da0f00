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

from .tables import first_pass


def fmt_us(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def pct(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{100 * v:.0f}%" if abs(v) >= 0.095 else f"{100 * v:.2g}%"


def md_table(head, body) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


def backend_names(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["backend"] for r in rows))


def cell(r: dict) -> str:
    """A row's figure: device-bound 'us (of floor, of read, BM n)'; host-bound 'mean +- standard error'."""
    if r.get("statistic") == "mean":
        return f"{fmt_us(r['us'])} +- {fmt_us(r.get('stderr_us'))}"
    parts = [pct(r.get("frac_of_floor"))] + ([f"read {pct(r['frac_of_read'])}"] if r.get("frac_of_read") else [])
    parts += [f"BM {r['block_m']}"] if r.get("block_m") else []
    return f"{fmt_us(r['us'])} ({', '.join(parts)})" + (" FAIL" if r.get("correct") is False else "")


def sweep_table(results: dict) -> tuple[list[str], list[list[str]]]:
    """One line per token count: the MXFP4 floor and read ceiling, each backend's figure, the speedups."""
    rows = first_pass(results["rows"])
    names = backend_names(rows)
    spd = {(s["tokens"], s["fused"]): s for s in results.get("speedup", [])}
    fused = [n for n in names if any(r["fused"] for r in rows if r["backend"] == n)]
    stream = any(r.get("read_us_stream") for r in rows)  # the streaming read (the ceiling until issue 47) beside
    head = (["tokens", "floor us (MXFP4)", "read us (MXFP4 bytes)"] + (["streaming read us"] if stream else [])
            + [f"{n} us" for n in names]
            + [f"{f} vs unfused" for f in fused if any("speedup" in s for s in spd.values() if s["fused"] == f)])
    body = []
    for t in sorted({r["tokens"] for r in rows}):
        at = {r["backend"]: r for r in rows if r["tokens"] == t}
        mx = next((r for r in at.values() if r["weight_format"] == "mxfp4"), next(iter(at.values())))
        mxfp4 = mx["weight_format"] == "mxfp4"
        read = fmt_us(mx.get("read_us")) + (f" ({mx['read_kernel']})" if mx.get("read_kernel") else "")
        line = [str(t), f"{fmt_us(mx['floor_mxfp4_us'])} ({mx['bound']})", read if mxfp4 else "-"]
        line += [fmt_us(mx.get("read_us_stream")) if mxfp4 else "-"] if stream else []
        line += [cell(at[n]) if n in at else "-" for n in names]
        for f in fused:
            if len(head) > len(line):
                s = spd.get((t, f))
                line.append(f"{s['speedup']:.2f}x" if s and "speedup" in s else "-")
        body.append(line)
    return head, body


def detail_table(results: dict) -> tuple[list[str], list[list[str]]]:
    head = ["backend", "tokens", "BM", "timed by", "figure us", "stat", "spread", "calls", "kineto us", "TFLOP/s",
            "GB/s", "floor us", "of floor", "read us", "of read", "calc_diff", "pass 2 us", "repeat spread"]
    rep = {(r["backend"], r["tokens"]): r for r in results.get("repeatability", [])}
    body = []
    for r in first_pass(results["rows"]):
        rp = rep.get((r["backend"], r["tokens"]))
        stat = r.get("statistic", "median") + (f" +- {fmt_us(r.get('stderr_us'))}" if r.get("statistic") == "mean" else "")
        body.append([r["backend"], str(r["tokens"]), str(r.get("block_m") or "-"), str(r.get("path", r["method"])),
                     fmt_us(r["us"]), stat, pct(r["spread"]), str(r["repeats"]), fmt_us(r.get("kineto_us")),
                     f"{r['tflops']:.3g}", f"{r['gbps']:.4g}", fmt_us(r["floor_us"]), pct(r["frac_of_floor"]),
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
            out.append(f"  - ceilings: copy {c['copy_gbps']:.0f} GB/s (read + written), FP8 {c['fp8_tflops']:.0f} TFLOP/s, "
                       f"bf16 {c['bf16_tflops']:.0f} TFLOP/s; read ceiling: {c.get('read') or 'not measured'}")
    if m.get("gpu"):
        out.append("- card: " + ", ".join(f"{k} {v}" for k, v in m["gpu"].items() if v))
    cfg = m.get("config", {})
    budget = (f">= {cfg.get('rep_ms')} ms of calls (at least {cfg.get('repeats')}) after >= {cfg.get('warmup_ms')} ms "
              f"of warm-up" if m.get("gpu") else f"{cfg.get('repeats')} calls (no CUDA device: host wall time)")
    out += [f"- device-bound rows: median of {budget}, L2 flushed (fused) or {cfg.get('rotate')} input sets rotated; "
            f"{cfg.get('passes')} passes, the repeatability bar 3%. Host-bound rows (+-): mean +- standard error over "
            f"{cfg.get('rep_ms')} ms of calls, one pass. Wall time {results.get('wall_seconds', '?')} s",
            "- 'of floor' = floor / time, floor = max(bytes of the experts touched + activations over copy bandwidth, "
            "FLOPs over the FP8 rate), each backend with its own weight format; 'read' = the fastest plain read of the "
            "same bytes / time (1.0 = as fast as reading them; the read kernel that was fastest in brackets)"]
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
    if results.get("skipped"):
        out += ["", "## Skipped", ""] + [f"- {k}: {v}" for k, v in results["skipped"].items()]
    if results.get("errors"):
        out += ["", "## Errors", ""] + [f"- {e['where']}: {e['error']}" for e in results["errors"]]
    return "\n".join(out) + "\n"


def write_all(results: dict, out_dir: str, plots: bool = True) -> list[str]:
    """results.json (written whole, then moved into place), results.jsonl (a record per timed row:
    ``megamoe.bench.jsonl``), results.md, and the plots when ``plots``."""
    os.makedirs(out_dir, exist_ok=True)
    p = os.path.join(out_dir, "results.json")
    with open(p + ".tmp", "w") as f:
        json.dump(results, f, indent=1, default=repr)
    os.replace(p + ".tmp", p)
    from .jsonl import write_jsonl

    written = [p, os.path.join(out_dir, "results.md"), write_jsonl(results, out_dir)]
    with open(written[1], "w") as f:
        f.write(to_markdown(results))
    if plots:
        from .plots import write_plots

        written += write_plots(results, out_dir)
    return written


def print_tables(results: dict, console=None) -> None:
    """The sweep table and the one-line verdicts (repeatability, overhead, cross-process, errors) on screen."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    c, m = results.get("ceilings") or {}, results["meta"]
    console.print(f"[bold]{m['card']}[/] {m['date']} commit {m['commit']}; ceilings: copy "
                  f"{c.get('copy_gbps', float('nan')):.0f} GB/s, FP8 {c.get('fp8_tflops', float('nan')):.0f} TFLOP/s")
    if results["rows"]:
        head, body = sweep_table(results)
        t = Table(title="time per layer, us (of floor, of the fastest read, BLOCK_M); host-bound rows: mean +- s.e.")
        for h in head:
            t.add_column(h, justify="right")
        for row in body:
            t.add_row(*row)
        console.print(t)
    rep = results.get("repeatability", [])
    if rep:
        flagged = [r for r in rep if r["flag"]]
        console.print(f"repeatability (device-bound rows): largest spread {100 * max(r['spread'] for r in rep):.2f}%; "
                      f"{len(flagged)} of {len(rep)} rows at or over 3%"
                      + "".join(f"\n  {r['backend']} T={r['tokens']}: {100 * r['spread']:.2f}%" for r in flagged))
    for r in results.get("overhead", []):
        console.print(f"overhead {r['backend']} T={r['tokens']}: harness / bare loop {r['ratio']:.4f} "
                      f"({'ok' if r['ok'] else 'OVER 2%'})")
    for x in results.get("cross_process", []):
        console.print(f"{x['backend']} T={x['tokens']} in processes {x['processes']}: "
                      f"{' / '.join(fmt_us(u) for u in x['us'])} us ({100 * x['change']:+.2f}%)")
    for k, v in results.get("skipped", {}).items():
        console.print(f"[yellow]skipped[/] {k}: {v}")
    for e in results.get("errors", []):
        console.print(f"[red]error[/] {e['where']}: {e['error']}")
