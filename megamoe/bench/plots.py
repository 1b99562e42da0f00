"""The figures of a ``megamoe bench`` results document, in the project's colours (``megamoe.palette``).

    sweep.png     time per layer vs tokens per rank, log-log: every backend (a later process's reading of a
                  backend already timed is dashed), the MXFP4 floor (black dashes), the FP8-weight floor (black
                  dots) and the measured read of the MXFP4 bytes (the read ceiling)
    block_m.png   every forced BLOCK_M against the plan's own choice

Without matplotlib (the ``plot`` extra) no figure is drawn; ``megamoe bench`` says so.
"""

from __future__ import annotations

import os

from ..palette import QUANTITY_COLOURS, backend_colour
from .tables import first_pass


def _loglog(ax, path: str, ylabel: str, title: str) -> None:
    import matplotlib.pyplot as plt

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set(xlabel="tokens per rank", ylabel=ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    ax.figure.savefig(path)
    plt.close(ax.figure)


def plot_sweep(results: dict, path: str) -> bool:
    import matplotlib.pyplot as plt

    rows = first_pass(results["rows"])
    if not rows:
        return False
    _, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    for n in dict.fromkeys(r["backend"] for r in rows):
        rr = sorted((r for r in rows if r["backend"] == n), key=lambda r: r["tokens"])
        name = rr[0].get("backend_name", n)
        ax.plot([r["tokens"] for r in rr], [r["us"] for r in rr], marker="o", color=backend_colour(name),
                ls="--" if name != n else "-", label=n)
    ts = sorted({r["tokens"] for r in rows})
    mx = {r["tokens"]: r for r in rows if r["weight_format"] == "mxfp4"} or {r["tokens"]: r for r in rows}
    ax.plot(*zip(*[(t, mx[t]["floor_mxfp4_us"]) for t in ts if t in mx]), "--", color=QUANTITY_COLOURS["floor"], lw=1.5,
            label="floor: MXFP4 bytes touched / copy BW, FLOPs / FP8 rate")
    read = [(t, mx[t]["read_us"]) for t in ts if t in mx and mx[t].get("read_us") and mx[t]["weight_format"] == "mxfp4"]
    if read:
        ax.plot(*zip(*read), ":", color=QUANTITY_COLOURS["read-ceiling"], lw=1.5, label="a plain read of the MXFP4 bytes")
    f8 = sorted((r["tokens"], r["floor_us"]) for r in rows if r["weight_format"] == "fp8_block")
    if f8:
        ax.plot(*zip(*dict(f8).items()), ":", color=QUANTITY_COLOURS["floor"], lw=1.2, label="floor (FP8 weights)")
    m = results["meta"]
    _loglog(ax, path, "time per layer (us)", f"{m.get('geometry', {}).get('name', '')} on {m['card']} "
                                             f"({m['date'][:10]}, {m['commit']})")
    return True


def plot_block_m(results: dict, path: str) -> bool:
    import matplotlib.pyplot as plt

    study = results.get("block_m") or []
    if not study:
        return False
    _, ax = plt.subplots(figsize=(8, 5), dpi=120)
    styles = ["-", "--", ":", "-."]
    for b in dict.fromkeys(s["backend"] for s in study):
        for k, bm in enumerate(sorted({s["forced_block_m"] for s in study if s["backend"] == b})):
            ss = sorted((s for s in study if s["backend"] == b and s["forced_block_m"] == bm), key=lambda s: s["tokens"])
            ax.plot([s["tokens"] for s in ss], [s["median_us"] for s in ss], marker="o", ls=styles[k % len(styles)],
                    color=backend_colour(ss[0].get("backend_name", b)), label=f"{b} BLOCK_M {bm}")
    plan = sorted((r for r in first_pass(results["rows"]) if r["backend"] in {s["backend"] for s in study}),
                  key=lambda r: r["tokens"])
    if plan:
        ax.plot([r["tokens"] for r in plan], [r["us"] for r in plan], "k--", lw=1, label="the plan's own choice")
    _loglog(ax, path, "device time (us)", "every forced BLOCK_M")
    return True


def write_plots(results: dict, out_dir: str) -> list[str]:
    """Draw what the results hold; returns the paths written ([] without matplotlib: the CLI says so)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        return []
    out = []
    for name, fn in (("sweep.png", plot_sweep), ("block_m.png", plot_block_m)):
        if fn(results, os.path.join(out_dir, name)):
            out.append(os.path.join(out_dir, name))
    return out
