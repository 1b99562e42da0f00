"""One colour per backend (and per recurring quantity), shared by the benchmark plots and the notebooks,
so that a reader who learns "orange is DeepGEMM FP4" in one figure can rely on it in every other.
Colours are matplotlib's tab10 names; grey is the reference's alone."""

from __future__ import annotations

BACKEND_COLOURS = {
    "flashinfer-mxfp4": "tab:blue",
    "deepgemm-sm90-fp8": "tab:green",
    "deepgemm-sm90-fp4": "tab:orange",
    "deepgemm-staged-fp8": "tab:purple",
    "megamoe-decode": "tab:red",
    "megamoe-decode-tc": "tab:pink",  # the headline decode kernel: its own colour, never the reference's grey
    "deepgemm-sm100-fp4": "tab:olive",  # a recipe only (no SM100 backend here): in the notebooks' error budgets
    "reference": "tab:gray",
}
# Backends without a colour of their own (a user's, registered at run time) take one of these, the same for the
# same name in every figure of a run: never the reference's grey.
SPARE_COLOURS = ("tab:cyan", "gold", "teal", "navy")
QUANTITY_COLOURS = {
    "floor": "black",  # bandwidth / FLOP floor lines
    "read-ceiling": "tab:brown",  # a plain read of the same bytes, measured
    "padding": "0.8",  # BLOCK_M / ragged padding rows
}


# The roles inside one CTA (megamoe.teaching.anatomy) and the two GEMM phases of a task, for the kernel pictures.
ROLE_COLOURS = {
    "dispatch": "tab:cyan",
    "TMA A": "tab:olive",
    "TMA B": "tab:brown",
    "decode": "tab:pink",
    "math": "tab:blue",
    "idle": "0.85",
}
PHASE_COLOURS = {"L1": "tab:olive", "L2": "tab:purple", "idle": "white"}


def role_colour(name: str) -> str:
    """The colour of a warp role ('math WG1' -> the 'math' colour; unknown roles grey)."""
    return ROLE_COLOURS.get(name.split(" WG")[0], "tab:gray")


def backend_colour(name: str) -> str:
    """The colour of backend ``name``: its own; a second process's reading ("name [p2]") the same as the first's;
    a name without one a spare colour picked from the name (stable across runs), never the reference's grey."""
    import re
    import zlib

    base = re.sub(r" \[p\d+\]$", "", name)
    if base in BACKEND_COLOURS:
        return BACKEND_COLOURS[base]
    return SPARE_COLOURS[zlib.crc32(base.encode()) % len(SPARE_COLOURS)]
