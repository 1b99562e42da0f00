"""What ``megamoe check`` prints and writes: per token count the dispatch pools, each stage's error against
``exact`` and the sanity checks; each fused backend's differential matrix; and, last, what was and was not
checked. Each table is built once as (title, head, body) from a report's dict (``CheckReport.to_dict()``, what
check.json holds) and shown on screen (``megamoe.tabular.show_table``: boxed where it fits, else Markdown) or
written to check.md (``markdown_table``), so that the screen and the report never disagree.

    stage_tables(rep)      calc_diff and rel_l2 vs exact: a row per kernel recipe, a column per stage
    sanity_table(rep)      every sanity check with its result and detail
    report_markdown(doc)   check.md: what was checked, every stage of every step, sanity, matrices
"""

from __future__ import annotations

from ..tabular import markdown_table, show_table
from . import MATRIX_BAD, STAGES, CheckReport

Table = tuple[str, list[str], list[list]]  # title, head, body


def _fmt(x: float) -> str:
    return "0" if x == 0 else f"{x:.2e}"


def _status(ok: bool, yes: str = "ok", no: str = "FAIL"):
    from rich.text import Text

    return Text(yes, style="green") if ok else Text(no, style="red")


def report_header(rep: dict) -> list[str]:
    """The step's geometry, counts and routing histogram, as lines."""
    g, h = rep["geometry"], rep["histogram"]
    empty = h["empty_experts"]
    return [f"preset {rep['preset']} (E={g['num_experts']}, K={g['num_topk']}, H={g['hidden']}, I={g['intermediate']}), "
            f"tokens per rank {rep['tokens_per_rank']}, ranks {rep['ranks']}, BLOCK_M {rep['block_m']}, seed {rep['seed']}",
            f"rows per expert: min {h['min']} / median {h['median']:g} / max {h['max']}; empty experts: {len(empty)}"
            + ((" " + str(empty[:16]) + (" ..." if len(empty) > 16 else "")) if empty else "")]


def pools_table(rep: dict) -> Table:
    return ("dispatch pools (simulated EP ranks)", ["rank", "experts", "routed rows", "pool rows (padded)"],
            [[str(p["rank"]), p["experts"], str(p["routed"]), str(p["pool"])] for p in rep["pool_rows"]])


def stage_tables(rep: dict) -> list[Table]:
    """Two tables, calc_diff and rel_l2 against exact: a row per kernel recipe, a column per stage (its shape in
    the header). Narrow enough for 80 columns with the full recipe names and numbers."""
    shapes = rep["stage_shapes"]
    head = ["recipe"] + [f"{s} [{'x'.join(map(str, shapes[s]))}]" for s in STAGES]
    errors = {(e["recipe"], e["stage"]): e for e in rep["errors"]}
    out = []
    for key in ("calc_diff", "rel_l2"):
        body = [[r] + [_fmt(errors[(r, s)][key]) if (r, s) in errors else "-" for s in STAGES]
                for r in rep["recipes"] if r != "exact"]
        out.append((f"error vs the exact recipe per stage: {key}", head, body))
    return out


def sanity_table(rep: dict) -> Table:
    return ("sanity checks", ["check", "result", "detail"],
            [[s["name"], _status(s["ok"]), s["detail"]] for s in rep["sanity"]])


def render_report(report: CheckReport, console) -> None:
    rep = report.to_dict()
    first, second = report_header(rep)
    console.print(f"[bold]megamoe check[/bold] {first}", highlight=False)
    console.print(second, highlight=False)
    for title, head, body in [pools_table(rep), *stage_tables(rep), sanity_table(rep)]:
        show_table(console, title, head, body, justify="lr")
    console.print("time: " + ", ".join(f"{k} {v:.2f}s" for k, v in report.seconds.items()))


def backends_table(avail) -> Table:
    return ("fused backends", ["backend", "runs here", "why not (or a warning)"],
            [[name, _status(ok, "yes", "no"), why] for name, ok, why in avail])


def render_backends(avail, console) -> None:
    show_table(console, *backends_table(avail))


def matrix_table(name: str, rows: list[dict]) -> Table:
    from rich.text import Text

    def num(r, k, fmt):
        v = r.get(k)
        return fmt.format(v) if isinstance(v, (int, float)) else "-"

    body = []
    for r in rows:
        st = r.get("status", "")
        color = "red" if st in MATRIX_BAD else ("green" if st in ("pass", "detected") else "yellow")
        rr = r.get("reference_recipe") or {}
        body.append([str(r.get("case")), Text(st, style=color), num(r, "calc_diff", "{:.2e}"),
                     num(r, "code_match", "{:.4f}"), num(r, "sf_rel_median", "{:.1e}"),
                     f"{rr.get('mma', '')}/{rr.get('accumulate', '')}" if rr else "-",
                     num(r, "launch_us", "{:.1f}"), str(r.get("plan", r.get("reason", r.get("error", ""))))[:60]])
    return (f"{name}: differential matrix (kernel vs its faithful reference)",
            ["case", "status", "calc_diff", "L2 codes", "L2 sf rel", "ref", "launch us", "plan"], body)


def render_matrix(name: str, rows: list[dict], console) -> None:
    show_table(console, *matrix_table(name, rows))


def render_summary(checked: list[str], not_checked: list[str], failed: int, console) -> None:
    """The last lines: what ran, what did not and why, and the verdict over what ran."""
    console.print("[bold]checked[/bold]")
    for line in checked:
        console.print(f"  - {line}", markup=False)
    if not_checked:
        console.print("[bold]not checked[/bold]")
        for line in not_checked:
            console.print(f"  - {line}", markup=False)
    if failed:
        console.print(f"[bold red]{failed} check(s) FAILED[/bold red]")
    else:
        kernels = not any(line.startswith("fused kernels") for line in not_checked)
        console.print("[bold green]all checks passed[/bold green]"
                      + ("" if kernels else " [yellow](the reference only: no fused kernel ran)[/yellow]"))


def _md(table: Table) -> list[str]:
    title, head, body = table
    return ["", f"### {title}", "", markdown_table(head, body)]


def report_markdown(doc: dict) -> str:
    """check.md from check.json's document: the verdict, what was and was not checked, then per step its header,
    pools, both stage tables and sanity checks; the distributed steps; each backend's matrix."""
    lines = ["# megamoe check", "", "## Checked", ""] + [f"- {c}" for c in doc["checked"]]
    if doc["not_checked"]:
        lines += ["", "## Not checked", ""] + [f"- {c}" for c in doc["not_checked"]]
    lines += ["", f"**{doc['failed']} check(s) failed**" if doc["failed"] else "All checks that ran passed."]
    for rep in doc["reports"]:
        lines += ["", f"## {rep['tokens_per_rank'][0]} tokens per rank", ""] + [f"{x}  " for x in report_header(rep)]
        for table in [pools_table(rep), *stage_tables(rep), sanity_table(rep)]:
            lines += _md(table)
    if doc.get("dist"):
        lines += ["", "## Distributed reference (real gloo ranks)", "", markdown_table(
            ["recipe", "tokens per rank", "result", "first mismatch"],
            [[d["recipe"], str(d["tokens_per_rank"]), d["result"], next(iter(v for v in d["mismatches"].values() if v), "")]
             for d in doc["dist"]])]
    for name, rows in doc.get("matrix", {}).items():
        lines += _md(matrix_table(name, rows))
    return "\n".join(lines) + "\n"
