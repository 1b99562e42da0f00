"""What ``megamoe check`` prints: per token count the dispatch pools, each stage's error against ``exact`` and
the sanity checks; each fused backend's differential matrix; and, last, what was and was not checked."""

from __future__ import annotations

from . import MATRIX_BAD, STAGES, CheckReport


def _fmt(x: float) -> str:
    return "0" if x == 0 else f"{x:.2e}"


def render_report(report: CheckReport, console) -> None:
    from rich.table import Table

    g = report.geometry
    h = report.histogram()
    empty = h["empty_experts"]
    console.print(
        f"[bold]megamoe check[/bold] preset [cyan]{report.preset}[/cyan] (E={g['num_experts']}, K={g['num_topk']}, "
        f"H={g['hidden']}, I={g['intermediate']}), tokens per rank {report.tokens_per_rank}, ranks {report.ranks}, "
        f"BLOCK_M {report.block_m}, seed {report.seed}"
    )
    console.print(
        f"rows per expert: min {h['min']} / median {h['median']:g} / max {h['max']}; "
        f"empty experts: {len(empty)}{(' ' + str(empty[:16]) + (' ...' if len(empty) > 16 else '')) if empty else ''}"
    )
    pools = Table(title="dispatch pools (simulated EP ranks)")
    for col in ("rank", "experts", "routed rows", "pool rows (padded)"):
        pools.add_column(col, justify="right")
    for p in report.pool_rows:
        pools.add_row(str(p["rank"]), p["experts"], str(p["routed"]), str(p["pool"]))
    console.print(pools)
    kernel = [r for r in report.recipes if r != "exact"]
    table = Table(title="error vs the exact recipe per stage: calc_diff / rel_l2")
    table.add_column("stage")
    table.add_column("shape", justify="right")
    for r in kernel:
        table.add_column(r, justify="right")
    for stage in STAGES:
        cells = [("-" if (e := report.error(r, stage)) is None else f"{_fmt(e.calc_diff)} / {_fmt(e.rel_l2)}") for r in kernel]
        table.add_row(stage, "x".join(map(str, report.stage_shapes[stage])), *cells)
    console.print(table)
    sanity = Table(title="sanity checks")
    for col in ("check", "result", "detail"):
        sanity.add_column(col)
    for s in report.sanity:
        sanity.add_row(s.name, "[green]ok[/green]" if s.ok else "[red]FAIL[/red]", s.detail)
    console.print(sanity)
    console.print("time: " + ", ".join(f"{k} {v:.2f}s" for k, v in report.seconds.items()))


def render_backends(avail, console) -> None:
    from rich.table import Table

    bt = Table(title="fused backends")
    for col in ("backend", "runs here", "why not (or a warning)"):
        bt.add_column(col)
    for name, ok, why in avail:
        bt.add_row(name, "[green]yes[/green]" if ok else "[yellow]no[/yellow]", why)
    console.print(bt)


def render_matrix(name: str, rows: list[dict], console) -> None:
    from rich.table import Table

    mt = Table(title=f"{name}: differential matrix (kernel vs its faithful reference)")
    for col in ("case", "status", "calc_diff", "L2 codes", "L2 sf rel", "ref", "launch us", "plan"):
        mt.add_column(col)
    for r in rows:
        def num(k, fmt):
            v = r.get(k)
            return fmt.format(v) if isinstance(v, (int, float)) else "-"
        st = r.get("status", "")
        color = "red" if st in MATRIX_BAD else ("green" if st in ("pass", "detected") else "yellow")
        rr = r.get("reference_recipe") or {}
        mt.add_row(str(r.get("case")), f"[{color}]{st}[/{color}]", num("calc_diff", "{:.2e}"),
                   num("code_match", "{:.4f}"), num("sf_rel_median", "{:.1e}"),
                   f"{rr.get('mma', '')}/{rr.get('accumulate', '')}" if rr else "-",
                   num("launch_us", "{:.1f}"), str(r.get("plan", r.get("reason", r.get("error", ""))))[:60])
    console.print(mt)


def render_summary(checked: list[str], not_checked: list[str], failed: int, console) -> None:
    """The last lines: what ran, what did not and why, and the verdict over what ran."""
    console.print("[bold]checked[/bold]")
    for line in checked:
        console.print(f"  - {line}")
    if not_checked:
        console.print("[bold]not checked[/bold]")
        for line in not_checked:
            console.print(f"  - {line}")
    if failed:
        console.print(f"[bold red]{failed} check(s) FAILED[/bold red]")
    else:
        kernels = not any(line.startswith("fused kernels") for line in not_checked)
        console.print("[bold green]all checks passed[/bold green]"
                      + ("" if kernels else " [yellow](the reference only: no fused kernel ran)[/yellow]"))
