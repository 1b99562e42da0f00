"""The Markdown report of lab/staging/staging_block.py, apart from the script so that the script holds
what runs on the H200 and this only formats what it recorded: (a) the bitwise verdicts in a line each,
(b) the staging speed over T as a table and the launch-shape sweep, (c) the block end to end as a table.

    markdown(RESULTS, seconds) -> str     RESULTS as staging_block.py fills it:
        {"meta": {...}, "errors": [part, ...], "a_bitwise": {...}, "b_speed": {"copy_bandwidth", "rows"},
         "b_sweep": [row, ...], "c_block": {"backend", "rows", ...} or {"skipped" | "error": ...}}

A part that raised holds {"error", "traceback"} instead: it is left out of the tables, and the header's
errors name it (part (c), skipped or raised, says so in a line).
"""

from __future__ import annotations


def markdown(results: dict, seconds: float) -> str:
    """The report of one run: ``results`` is the script's RESULTS (meta, errors, and what each part
    returned, a part that raised holding its error), ``seconds`` the run's wall time so far."""
    m = results["meta"]
    lines = [f"# Staging kernel and DeepSeek-V4 block on {m.get('device')}", "",
             f"torch {m.get('torch')}, triton {m.get('triton')}; total {seconds:.0f} s; errors: {results['errors'] or 'none'}", ""]
    a = results.get("a_bitwise", {})
    if "cases" in a:
        for cast in ("hw", "bits"):
            rows = [r for r in a["cases"] if r["cast"] == cast]
            lines.append(f"- (a) cast={cast}: {sum(r['ok'] for r in rows)}/{len(rows)} cases bit-exact")
        lines.append(f"- (a) NaN/Inf: {a.get('nonfinite')}; vs deep_gemm: "
                     f"{a['deep_gemm'] if isinstance(a.get('deep_gemm'), str) else [(d['case'], d['ok']) for d in a['deep_gemm']]}")
    b = results.get("b_speed", {})
    if "rows" in b:
        lines += ["", f"(b) DeepSeek-V4-Flash H=4096 K=6; device copy {b['copy_bandwidth']['GBps']:.0f} GB/s (read + written), "
                  "measured in this run. Median us, L2 flushed before every call, input sets rotated. 'events': "
                  "megamoe.bench.timing.time_fn (one event pair per call, queued behind a spin so the Python launch "
                  "is outside the pair); 'graph': the same call replayed from a CUDA graph. Floor = bytes / copy "
                  "bandwidth; 'of floor' uses the graph figure.", "",
                  "| T | bytes | floor us | eager us | eager no-sync us (graph) | triton us (graph) | of floor | GB/s | "
                  "+flag check us | bits cast us | isfinite us | eager / triton | host us eager / triton / flag |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in b["rows"]:
            lines.append(f"| {r['T']} | {r['bytes']} | {r['floor_us']:.1f} | {r['eager_us']:.1f} | "
                         f"{r['eager_nocheck_us']:.1f} ({r['eager_nocheck_graph_us']:.1f}) | "
                         f"{r['triton_us']:.1f} ({r['triton_graph_us']:.1f}) | {100 * r['frac_floor']:.0f}% | {r['GBps']:.0f} | "
                         f"{r['triton_flag_us']:.1f} | {r['triton_bits_us']:.1f} | {r['isfinite_all_us']:.1f} | "
                         f"{r['speedup_vs_eager']:.1f} | "
                         f"{r['eager_host_us']:.0f} / {r['triton_host_us']:.0f} / {r['triton_flag_host_us']:.0f} |")
    s = results.get("b_sweep")
    if isinstance(s, list):
        lines += ["", "(b) launch shapes (BLOCK_T, BLOCK_G, num_warps), us:", ""]
        for r in s:
            lines.append(f"- T={r['T']}: default {r['default']} ; best {r['best']} {r['best_us']:.1f} us; "
                         + ", ".join(f"{k} {v:.1f}" for k, v in r.items() if k.startswith("(")))
    c = results.get("c_block", {})
    if "rows" in c:
        lines += ["", f"(c) block with {c['backend']} (plans built in {c.get('build_s', 0):.0f} s). stage = stage_into "
                  "(triton) straight into the backend's buffer; launch = the fused kernel alone; share = stage (graph) / "
                  "(stage (graph) + launch); calc_diff of the fused block and its routed part against the reference block "
                  "(same recipe, the kernel's weights); same y = the kernel's output after our staging equals it after the "
                  "backend's own staging, bit for bit.", "",
                  "| T | stage us (graph) | launch us | share | backend's stage() us | calc_diff block | calc_diff routed | "
                  "same routing | max tokens/expert | same y | block host us |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in c["rows"]:
            if "stage_us" in r:
                bad = {k: v for k, v in r.items() if k.startswith("nonfinite_")}
                lines.append(f"| {r['T']} | {r['stage_us']:.1f} ({r['stage_graph_us']:.1f}) | {r['launch_us']:.1f} | "
                             f"{r['stage_share']:.4f} | {r['backend_stage_us']:.1f} | "
                             f"{r.get('calc_diff_block', float('nan')):.2e} | {r.get('calc_diff_routed', float('nan')):.2e}"
                             f"{' ' + str(bad) if bad else ''} | {r.get('same_routing')} | {r.get('max_tokens_per_expert')} | "
                             f"{r['y_bitwise_vs_backend_staging']} | {r['block_fused_host_us']:.0f} |")
            else:
                lines.append(f"| {r['T']} | {r.get('error') or r.get('skipped')} |")
    elif c:
        lines.append(f"\n(c) {c.get('skipped') or c.get('error')}")
    return "\n".join(lines) + "\n"
