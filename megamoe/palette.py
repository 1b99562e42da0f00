"""One colour per backend (and per recurring quantity), shared by the benchmark plots and the notebooks,
so that a reader who learns "orange is DeepGEMM FP4" in one figure can rely on it in every other.
Colours are matplotlib's tab10 names; unknown names fall back to grey."""

from __future__ import annotations

BACKEND_COLOURS = {
    "flashinfer-mxfp4": "tab:blue",
    "deepgemm-sm90-fp8": "tab:green",
    "deepgemm-sm90-fp4": "tab:orange",
    "deepgemm-staged-fp8": "tab:purple",
    "megamoe-decode": "tab:red",
    "reference": "tab:gray",
}
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
    """The colour of backend ``name`` ('tab:gray' for names without one)."""
    return BACKEND_COLOURS.get(name, "tab:gray")
