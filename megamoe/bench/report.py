"""Results of one ``megamoe bench`` call as files and screen tables.

    results.json   everything (meta, ceilings, rows with samples, derived tables, errors)
    results.md     the tables below in Markdown (for bench/results/ and the README)
    sweep.png      time vs tokens per backend, log-log, the roofline floor drawn
    block_m.png    every forced BLOCK_M vs tokens (when the study ran)
"""

from __future__ import annotations

import json
import math
import os

from .timing import pass_spread


def _fmt_us(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def _pct(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{100 * v:.0f}%" if abs(v) >= 0.095 else f"{100 * v:.2g}%"


def first_pass(results: dict) -> list[dict]:
    return [r for r in results["rows"] if r["pass"] == 0]


def backend_names(results: dict) -> list[str]:
    seen = []
    for r in results["rows"]:
        if r["backend"] not in seen:
            seen.append(r["backend"])
    return seen


def sweep_table(results: dict) -> tuple[list[str], list[list[str]]]:
    """One row per token count: floor, then per backend 'time us (floor/time) BLOCK_M', then speedups."""
    rows = first_pass(results)
    names = backend_names(results)
    spd = {(s["tokens"], s["fused"]): s for s in results.get("speedup", [])}
    fused = [n for n in names if any(r["fused"] for r in rows if r["backend"] == n)]
    head = ["tokens", "floor us (MXFP4)"] + [f"{n} us (of floor, BM)" for n in names] + [f"{f} speedup vs unfused" for f in fused]
    body = []
    for t in sorted({r["tokens"] for r in rows}):
        at = {r["backend"]: r for r in rows if r["tokens"] == t}
        any_r = next(iter(at.values()))
        line = [str(t), f"{_fmt_us(any_r['floor_mxfp4_us'])} ({any_r['bound']})"]
        for n in names:
            r = at.get(n)
            if r is None:
                line.append("-")
                continue
            bm = f", BM {r['block_m']}" if r.get("block_m") is not None else ""
            bad = " FAIL" if r.get("correct") is False else ""
            line.append(f"{_fmt_us(r['median_us'])} ({_pct(r['frac_of_floor'])}{bm}){bad}")
        for f in fused:
            s = spd.get((t, f))
            line.append(f"{s['speedup']:.2f}x" if s and "speedup" in s else "-")
        body.append(line)
    return head, body


def detail_table(results: dict) -> tuple[list[str], list[list[str]]]:
    head = ["backend", "tokens", "BM", "timed by", "median us", "spread", "TFLOP/s", "GB/s", "of FP8 peak", "of copy BW",
            "floor us", "of floor", "calc_diff", "pass 2 us", "repeat spread", "between input sets"]
    rep = {(r["backend"], r["tokens"]): r for r in results.get("repeatability", [])}
    body = []
    for r in first_pass(results):
        rp = rep.get((r["backend"], r["tokens"]))
        body.append([r["backend"], str(r["tokens"]), str(r.get("block_m") or "-"), _method(r), _fmt_us(r["median_us"]),
                     _pct(r["spread"]), f"{r['tflops']:.3g}", f"{r['gbps']:.4g}", _pct(r["frac_fp8_peak"]),
                     _pct(r["frac_copy_bw"]), _fmt_us(r["floor_us"]), _pct(r["frac_of_floor"]),
                     f"{r['calc_diff']:.1e}" if r.get("calc_diff") is not None else "-",
                     _fmt_us(rp["medians_us"][1]) if rp else "-",
                     (f"{100 * rp['spread']:.2f}%" + (" (over)" if rp.get("flag") else "")) if rp else "-",
                     _pct(r.get("rotation_spread")) if r.get("rotation_spread") is not None else "-"])
    return head, body


def _method(r: dict) -> str:
    """How a row was timed: the clock (``method``), and the harness's pick (``path``) when they differ."""
    m, p = r.get("method", "-"), r.get("path")
    return m if not p or p == m else f"{m} ({p})"


def _worst(rep: list[dict]) -> dict:
    return max(rep, key=lambda r: r["spread"] if r["spread"] == r["spread"] else float("inf"))


def repeatability_text(results: dict) -> list[str]:
    """The repeatability paragraph, every flagged row listed, and the drift check."""
    rep = results.get("repeatability", [])
    proto = results.get("meta", {}).get("timing_protocol", {})
    limit = proto.get("repeat_limit", 0.03)
    out = []
    if rep:
        worst = _worst(rep)
        flagged = [r for r in rep if r.get("flag", r["spread"] >= limit)]
        how = proto.get("repeat") or "two sweeps back to back in one call"
        out += [f"Protocol ({proto.get('repeat_mode', 'sweeps')}): {how}. Largest per-row spread "
                f"{100 * worst['spread']:.2f}% ({worst['backend']} at {worst['tokens']} tokens); {len(flagged)} of "
                f"{len(rep)} rows at or over {100 * limit:.0f}%."]
        if flagged:
            # The card's state around each pass of a host-bound row (nvidia-smi: SM MHz, memory MHz, W,
            # P-state, clock-event reasons), where the sweep recorded it: the first place to look for a cause.
            state = {(r["backend"], r["tokens"], r["pass"]): f"{r['gpu_before']} -> {r.get('gpu_after', '')}"
                     for r in results.get("rows", []) if r.get("gpu_before")}

            def card(r):
                return " / ".join(state.get((r["backend"], r["tokens"], p), "-") for p in range(len(r["medians_us"])))

            out += ["", md_table(["backend", "tokens", "pass medians us", "spread", "card before -> after, per pass"],
                                 [[r["backend"], str(r["tokens"]), ", ".join(_fmt_us(m) for m in r["medians_us"]),
                                   f"{100 * r['spread']:.2f}%", card(r)] for r in flagged])]
    out += host_speed_text(results)
    drift = results.get("drift") or []
    if drift:
        out += ["", "Drift over the sweep (each backend's first case timed again at the end):", "",
                md_table(["backend", "tokens", "start us", "end us", "change", "flag"],
                         [[d["backend"], str(d["tokens"]), _fmt_us(d["start_us"]), _fmt_us(d["end_us"]),
                           f"{100 * d['change']:+.2f}%", "OVER" if d.get("flag") else ""] for d in drift])]
    return out


def host_speed_text(results: dict) -> list[str]:
    """The host's speed around the host-bound rows: the CPU probe's calibration, and every pass that was
    retaken because the probe read the host slow, or kept slow after the last retake (``host_slow``)."""
    probed = [r for r in results.get("rows", []) if r.get("host_probe_median_us") is not None]
    if not probed:
        return []
    cal = results.get("meta", {}).get("host_probe_calibration_us")
    hit = [r for r in probed if r.get("host_retaken") or r.get("host_slow") or r.get("host_clean") is False
           or r.get("host_rejudged") or r.get("host_short")]
    n = sum(len(r.get("host_retaken") or []) for r in probed)
    out = ["", f"Host speed (host-bound rows; a fixed CPU probe between timed batches, calibration "
               f"{_fmt_us(cal) if cal else '-'} us): {n} of {n + len(probed)} passes retaken while the probe read "
               f"the host slow; {sum(bool(r.get('host_slow')) for r in probed)} kept slow (host_slow)."]
    filtered = [r for r in probed if "host_batches_aside" in r]
    if filtered:
        aside = [r for r in filtered if r["host_batches_aside"]]
        out[-1] += (f" Within the kept passes, {sum(r['host_batches_aside'] for r in aside)} batches "
                    f"({sum(r['host_calls_aside'] for r in aside)} calls) of {len(aside)} passes were set aside for a "
                    f"slow probe beside them; {sum(r.get('host_clean') is False for r in filtered)} passes found too "
                    f"few clean batches and kept every sample (host_clean false); "
                    f"{sum(bool(r.get('host_short')) for r in filtered)} kept passes ran out of time short of their "
                    f"minimum (host_short).")
    rejudged = [r["host_rejudged"] for r in probed if r.get("host_rejudged")]
    if rejudged:
        out[-1] += (f" {len(rejudged)} passes kept at first were over the limit once the run's fastest probe fell; "
                    f"{sum(x['re_timed'] for x in rejudged)} of them were re-timed.")
    spent = results.get("meta", {}).get("host_extra_s")
    if spent is not None:
        budget = results.get("meta", {}).get("config", {}).get("host_extra_budget_s")
        out[-1] += (f" The check spent {spent:.1f} s" + (f" of its {budget:g} s budget" if budget is not None else "")
                    + f"; {sum(bool(r.get('host_budget_spent')) for r in probed)} slow passes were kept unretaken "
                    f"once it was spent.")
    out[-1] += refilter_text(probed)
    if hit:
        out += ["", md_table(["backend", "tokens", "pass", "kept us (probe us)", "retaken us (probe us)",
                              "batches set aside", "host_slow"],
                             [[r["backend"], str(r["tokens"]), str(r["pass"]),
                               f"{_fmt_us(r['median_us'])} ({_fmt_us(r['host_probe_median_us'])})",
                               _earlier_takes(r),
                               str(r.get("host_batches_aside", "-")) + (" (not clean)" if r.get("host_clean") is False else "")
                               + (" (short)" if r.get("host_short") else ""),
                               "host_slow" if r.get("host_slow") else ""] for r in hit])]
    return out


def refilter_text(rows: list[dict]) -> str:
    """One sentence on ``host_refilter`` (recorded, not used in the figures): how many passes the run's
    final limit would have thinned, and the largest pass-to-pass spread of the host-bound rows with and
    without the re-selection (a pair counts only where every pass keeps its minimum calls)."""
    redone = [r for r in rows if r.get("host_refilter")]
    if not redone:
        return ""
    limit = redone[0]["host_refilter"]["limit_us"]
    thinner = sum(r["host_refilter"]["calls"] < len(r.get("samples_us") or []) for r in redone)
    by: dict = {}
    for r in redone:
        by.setdefault((r["backend"], r["tokens"]), []).append(r)
    now, then = [], []
    for rs in by.values():
        if len(rs) >= 2 and all(x["host_refilter"]["enough"] for x in rs):
            now.append(pass_spread([x["median_us"] for x in rs]))
            then.append(pass_spread([x["host_refilter"]["median_us"] for x in rs]))
    text = (f" Re-selected from their recorded batches against the run's final limit ({_fmt_us(limit)} us; on "
            f"record as host_refilter, not used in the figures): {thinner} of {len(redone)} passes would keep fewer calls")
    if now:
        text += (f"; over the {len(now)} row{'s' if len(now) != 1 else ''} whose passes all keep their minimum, "
                 f"the largest pass-to-pass spread "
                 f"would be {100 * max(then):.2f}% (as timed: {100 * max(now):.2f}%)")
    return text + "."


def _earlier_takes(r: dict) -> str:
    """A host-bound row's takes before the kept one: its retakes, and a first take re-timed once the run's
    baseline fell (``host_rejudged``), each as "us (probe us)"."""
    takes = [f"{_fmt_us(x['median_us'])} ({_fmt_us(x['host_probe_median_us'])})" for x in r.get("host_retaken") or []]
    x = r.get("host_rejudged")
    if x:
        takes.append(f"first take {_fmt_us(x['median_us'])} ({_fmt_us(x['host_probe_median_us'])}), "
                     + ("re-timed later" if x["re_timed"] else "not re-timed: no budget or time"))
    return ", ".join(takes) or "-"


def _best_bm(r: dict) -> str:
    if r["best_block_m"] is not None:
        return str(r["best_block_m"])
    return "- (BM " + ", ".join(map(str, r.get("missing") or [])) + " not timed)"


def md_table(head, body) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def benchmark_json_markdown(bench: dict, commit: str | None = None) -> str:
    """pytest-benchmark's JSON (``--benchmark-json``) as a markdown table of what its own table leaves out:
    each test's ``extra_info`` (the harness's device time, spread, rates, fractions of the ceilings and
    of the floor, BLOCK_M, calc_diff) beside pytest-benchmark's wall-clock median. The ceilings test's
    rates are a line of their own. ``commit`` overrides the JSON's git id (a device copy's git HEAD can
    be stale)."""
    rows, ceil = [], None
    for b in bench.get("benchmarks", []):
        e = b.get("extra_info", {})
        if "device_us" not in e:
            ceil = ceil or (e if "copy_gbps" in e else None)
            continue
        rows.append([b["name"], _fmt_us(e["device_us"]), _pct(e.get("spread")), str(e.get("method", "-")),
                     str(e.get("repeats", "-")), _fmt_us(b["stats"]["median"] * 1e6),
                     f"{e['tflops']:.3g}" if e.get("tflops") is not None else "-",
                     f"{e['gbps']:.4g}" if e.get("gbps") is not None else "-",
                     _pct(e.get("frac_of_floor")), str(e.get("block_m", "-")),
                     f"{e['calc_diff']:.1e}" if e.get("calc_diff") is not None else "-",
                     f"{e['ratio']:.4f}" if e.get("ratio") is not None else "-"])
    m = bench.get("machine_info", {})
    c = bench.get("commit_info", {})
    meta = m.get("megamoe", {})  # bench/conftest.py's run_metadata (absent from older JSONs)
    sha = commit or meta.get("commit") or f"{str(c.get('id', '-'))[:10]}{' dirty' if c.get('dirty') else ''}"
    out = [f"# pytest bench/ ({bench.get('datetime', '-')}, commit {sha}, {m.get('node', '-')}, "
           f"python {m.get('python_version', '-')})", ""]
    if meta.get("versions"):
        out.append("- versions: " + ", ".join(f"{k} {val}" for k, val in meta["versions"].items()))
    if meta.get("gpu"):
        out.append(f"- card: {meta.get('card', '-')}, " + ", ".join(f"{k} {val}" for k, val in meta["gpu"].items() if val))
    if out[-1] != "":
        out.append("")
    if ceil:
        out += [f"- ceilings measured in the session ({ceil.get('device', '-')}): copy {ceil['copy_gbps']:.0f} GB/s, "
                f"FP8 {ceil.get('fp8_tflops', float('nan')):.4g} TFLOP/s, bf16 {ceil.get('bf16_tflops', float('nan')):.4g} TFLOP/s", ""]
    out.append(md_table(["test", "device us", "spread", "timed by", "calls", "wall us (pytest-benchmark)", "TFLOP/s",
                         "GB/s", "of floor", "BM", "calc_diff", "harness / bare"], rows))
    return "\n".join(out) + "\n"


def to_markdown(results: dict) -> str:
    m, c = results["meta"], results.get("ceilings") or {}
    v = m.get("versions", {})
    out = [f"# megamoe bench: {m['geometry']['name'] if 'geometry' in m else ''} on {m['card']}", "",
           f"- date {m['date']}, commit `{m['commit']}`{' (dirty tree)' if m.get('dirty') else ''}",
           "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
           ]
    if m.get("gpu"):
        out.append("- card: " + ", ".join(f"{k} {val}" for k, val in m["gpu"].items() if val))
    if c:
        out.append(f"- ceilings measured in this run: copy {c['copy_gbps']:.0f} GB/s (read + written), "
                   f"FP8 matmul {c['fp8_tflops']:.0f} TFLOP/s, bf16 {c['bf16_tflops']:.0f} TFLOP/s")
    cfg = m.get("config", {})
    methods = sorted({r["method"] for r in results["rows"]}) or ["-"]
    out.append(f"- timing: median of {cfg.get('repeats')} calls after {cfg.get('warmup')} warm-up calls ({', '.join(methods)}), "
               f"L2 flushed between calls (fused) / {cfg.get('rotate')} input sets rotated (callables); "
               f"wall time of the run {results.get('wall_seconds', '?')} s")
    proto = m.get("timing_protocol")
    if proto:
        out.append("- paths: " + "; ".join(f"{k}: {v}" for k, v in proto.get("paths", {}).items()))
        db = proto.get("device_bound", {})
        if db:
            out.append("- device-bound rows: " + ", ".join(f"{k} {v}" for k, v in db.items()))
        hb = proto.get("host_bound", {})
        if hb:
            out.append("- host-bound rows (eager reference, a peer whose launch syncs the host): "
                       + ", ".join(f"{k} {v}" for k, v in hb.items()))
    out.append("- 'of floor' = floor / time (100% = at the roofline floor); floor = max(bytes of the experts touched "
               "+ activations over copy bandwidth, FLOPs over the FP8 rate), with each backend's own weight format")
    if results["rows"]:
        out += ["", "## Sweep", "", md_table(*sweep_table(results))]
        out += ["", "## Every row", "", md_table(*detail_table(results))]
    text = repeatability_text(results)
    if text:
        out += ["", "## Repeatability", ""] + text
    if results.get("block_m_best"):
        bms = sorted({k for r in results["block_m_best"] for k in r["times_us"]}, key=int)
        head = ["backend", "tokens", "plan BM", "plan us"] + [f"BM {b} us" for b in bms] + ["best BM", "plan / best"]
        body = [[r["backend"], str(r["tokens"]), str(r["plan_block_m"]), _fmt_us(r["plan_us"])]
                + [_fmt_us(r["times_us"].get(b)) for b in bms]
                + [_best_bm(r), f"{r['plan_over_best']:.3f}" if r["plan_over_best"] else "-"]
                for r in results["block_m_best"]]
        out += ["", "## BLOCK_M study (every forced BLOCK_M)", "", md_table(head, body)]
    if results.get("ragged"):
        head = ["backend", "mean", "rank counts", "agreed", "own BMs", "agreed BM", "step own us", "step padded us", "padding cost"]
        body = [[r["backend"], str(r["mean_tokens"]), str(r["counts"]), str(r["agreed"]),
                 str([x["own_block_m"] for x in r["ranks"]]), str(r["ranks"][0]["agreed_block_m"]),
                 _fmt_us(r["step_own_us"]), _fmt_us(r["step_padded_us"]), _pct(r["padding_cost"])] for r in results["ragged"]]
        out += ["", "## Ragged step (each rank timed alone on one GPU)", "", md_table(head, body)]
    if results.get("staging"):
        keys = sorted({k for r in results["staging"] for k in r if k.startswith("frac_of ")})
        head = ["what", "tokens", "us"] + [k.replace("frac_of ", "of ") for k in keys]
        body = [[r["what"], str(r["tokens"]), _fmt_us(r["median_us"])] + [_pct(r.get(k)) for k in keys] for r in results["staging"]]
        out += ["", "## Staging cost", "", md_table(head, body)]
    if results.get("overhead"):
        head = ["backend", "tokens", "timed by", "input sets", "bare loop us", "harness us", "harness / bare", "within 2%",
                "harness median us", "between input sets", "harness, L2 flushed us"]
        body = [[r["backend"], str(r["tokens"]), r.get("path", r.get("method", "-")), str(r.get("sets", 1)),
                 _fmt_us(r["bare_loop_us"]), _fmt_us(r["harness_us"]), f"{r['ratio']:.4f}", "yes" if r["ok"] else "NO",
                 _fmt_us(r.get("harness_median_us")), _pct(r.get("rotation_spread")) if r.get("rotation_spread") is not None else "-",
                 _fmt_us(r.get("harness_flushed_us"))] for r in results["overhead"]]
        note = results["overhead"][0].get("compared")
        out += ["", "## Harness overhead", ""] + ([f"Compared: {note}.", ""] if note else []) + [md_table(head, body)]
    if results.get("skipped"):
        out += ["", "## Skipped", ""] + [f"- {k}: {v}" for k, v in results["skipped"].items()]
    if results.get("errors"):
        out += ["", "## Errors", ""] + [f"- {e['where']}: {e['error']}" for e in results["errors"]]
    return "\n".join(out) + "\n"


def plot_sweep(results: dict, path: str) -> bool:
    rows = first_pass(results)
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    for n in backend_names(results):
        rr = sorted((r for r in rows if r["backend"] == n), key=lambda r: r["tokens"])
        ax.plot([r["tokens"] for r in rr], [r["median_us"] for r in rr], marker="o", label=n)
    ts = sorted({r["tokens"] for r in rows})
    fl = {r["tokens"]: r["floor_mxfp4_us"] for r in rows}
    ax.plot(ts, [fl[t] for t in ts], "k--", lw=1.5, label="floor (MXFP4 bytes touched / copy BW, FLOPs / FP8 rate)")
    fmts = {r["weight_format"] for r in rows}
    if "fp8_block" in fmts:
        f8 = {r["tokens"]: r["floor_us"] for r in rows if r["weight_format"] == "fp8_block"}
        t8 = sorted(f8)
        ax.plot(t8, [f8[t] for t in t8], "k:", lw=1.2, label="floor (FP8 weights)")
    m = results["meta"]
    title = f"{m.get('geometry', {}).get('name', '')} on {m['card']} ({m['date'][:10]}, {m['commit']})"
    return _finish_loglog(fig, ax, path, "device time per layer (us)", title)


def _finish_loglog(fig, ax, path: str, ylabel: str, title: str) -> bool:
    """Log-log axes over tokens per rank, grid, legend; save to ``path`` and close the figure."""
    import matplotlib.pyplot as plt

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def plot_block_m(results: dict, path: str) -> bool:
    study = results.get("block_m") or []
    if not study:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for (b, bm) in sorted({(s["backend"], s["forced_block_m"]) for s in study}):
        ss = sorted((s for s in study if s["backend"] == b and s["forced_block_m"] == bm), key=lambda s: s["tokens"])
        ax.plot([s["tokens"] for s in ss], [s["median_us"] for s in ss], marker="o", label=f"{b} BLOCK_M {bm}")
    plan = sorted((r for r in first_pass(results) if r["fused"] and r["backend"] in {s["backend"] for s in study}),
                  key=lambda r: r["tokens"])
    if plan:
        ax.plot([r["tokens"] for r in plan], [r["median_us"] for r in plan], "k--", lw=1, label="plan's own choice")
    return _finish_loglog(fig, ax, path, "device time (us)", "every forced BLOCK_M")


def write_all(results: dict, out_dir: str, plots: bool = True) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    written = []
    p = os.path.join(out_dir, "results.json")
    with open(p + ".tmp", "w") as f:
        json.dump(results, f, indent=1, default=repr)
    os.replace(p + ".tmp", p)
    written.append(p)
    p = os.path.join(out_dir, "results.md")
    with open(p, "w") as f:
        f.write(to_markdown(results))
    written.append(p)
    if plots:
        for name, fn in (("sweep.png", plot_sweep), ("block_m.png", plot_block_m)):
            try:
                if fn(results, os.path.join(out_dir, name)):
                    written.append(os.path.join(out_dir, name))
            except ImportError:
                pass
    return written


def print_tables(results: dict, console=None) -> None:
    """Rich tables on screen (plain Markdown when rich is missing)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(to_markdown(results))
        return
    console = console or Console()
    c = results.get("ceilings") or {}
    m = results["meta"]
    console.print(f"[bold]{m['card']}[/] {m['date']} commit {m['commit']}; ceilings: copy {c.get('copy_gbps', float('nan')):.0f} GB/s, "
                  f"FP8 {c.get('fp8_tflops', float('nan')):.0f} TFLOP/s, bf16 {c.get('bf16_tflops', float('nan')):.0f} TFLOP/s")
    if results["rows"]:
        head, body = sweep_table(results)
        t = Table(title="time per layer, us (floor / time, BLOCK_M)", show_lines=False)
        for h in head:
            t.add_column(h, justify="right")
        for row in body:
            t.add_row(*row)
        console.print(t)
    rep = results.get("repeatability", [])
    if rep:
        worst = _worst(rep)
        flagged = [r for r in rep if r.get("flag")]
        console.print(f"repeatability: worst per-row spread {100 * worst['spread']:.2f}% ({worst['backend']} T={worst['tokens']}); "
                      f"{len(flagged)} of {len(rep)} rows at or over the limit"
                      + "".join(f"\n  {r['backend']} T={r['tokens']}: {100 * r['spread']:.2f}%" for r in flagged))
    for d in results.get("drift", []):
        console.print(f"drift {d['backend']} T={d['tokens']}: {d['start_us']:.1f} -> {d['end_us']:.1f} us "
                      f"({100 * d['change']:+.2f}%){' OVER' if d.get('flag') else ''}")
    for r in results.get("overhead", []):
        rot = r.get("rotation_spread")
        console.print(f"overhead {r['backend']} T={r['tokens']} ({r.get('path', r.get('method'))}, {r.get('sets', 1)} set(s)): "
                      f"harness {r['harness_us']:.1f} us vs bare loop {r['bare_loop_us']:.1f} us, ratio {r['ratio']:.4f} "
                      f"({'ok' if r['ok'] else 'OVER 2%'})" + (f"; between input sets {100 * rot:.1f}%" if rot is not None else ""))
    for e in results.get("errors", []):
        console.print(f"[red]error[/] {e['where']}: {e['error']}")
