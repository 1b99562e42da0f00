"""Execute every walkthrough notebook on the CPU, top to bottom, and check that its figures render.

Each ``notebooks/NN_*.py`` (jupytext percent format) is converted to a notebook, run by nbclient in a
fresh ipykernel of *this* interpreter (a kernelspec written to a temp dir, so a stale or missing
``python3`` kernelspec on the machine does not matter), with matplotlib's Agg backend and one
intra-op thread. A cell that
raises fails the test with the cell's traceback. All notebooks together must run in under 5 minutes.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext", reason="pip install -e .[notebooks]")
nbclient = pytest.importorskip("nbclient", reason="pip install -e .[notebooks]")
pytest.importorskip("ipykernel", reason="pip install -e .[notebooks]")
pytest.importorskip("matplotlib", reason="pip install -e .[notebooks]")

from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
NB_DIR = REPO / "notebooks"
TOTAL_BUDGET_S = 300.0
CELL_TIMEOUT_S = 240

# Every figure each notebook must save (notebooks/figures/<notebook>/<name>.png), one or more per stage.
EXPECTED_FIGURES = {
    "01_routing_dispatch": ["expert_histogram", "bias_balancing", "pool_layout", "padding_waste"],
    "02_fp8_staging": ["scales", "error_per_element", "error_vs_granularity", "multiply_vs_divide"],
    "03_mxfp4_weights": ["e2m1_grid", "scale_bytes", "decoder_range", "decode_table_measured", "layer_error_by_range",
                         "tc_fragment_layout"],
    "04_gemms_swiglu_requant": ["l1_promotion", "swiglu_clamp", "l2_requant", "error_budget", "tc_accumulation"],
    "05_combine_and_expert_parallelism": ["slot_outputs", "combine_order", "ep_traffic", "ragged_agreement"],
    "06_kernel_walkthrough": ["plan_vs_tokens", "tiles_per_wave", "bytes_flops_per_stage", "roofline", "warp_roles",
                              "smem_stages", "tma_wgmma_pipeline", "dispatch_combine", "persistent_schedule",
                              "kernels_side_by_side"],
}
MIN_PNG_BYTES = 15_000  # measured: empty axes at our sizes save as 8-10 KB; our real figures are >= 20 KB

_durations: dict[str, float] = {}


def _notebooks() -> list[str]:
    return sorted(p.stem for p in NB_DIR.glob("[0-9][0-9]_*.py"))


def test_every_notebook_declares_its_figures():
    assert _notebooks(), f"no notebooks found in {NB_DIR}"
    assert sorted(EXPECTED_FIGURES) == _notebooks(), "EXPECTED_FIGURES and notebooks/NN_*.py disagree"


@pytest.fixture(scope="module")
def kernel_spec_dir(tmp_path_factory) -> Path:
    """A kernelspec that launches ipykernel with this interpreter, the repo importable, Agg backend."""
    root = tmp_path_factory.mktemp("kernels")
    spec = root / "megamoe-nb"
    spec.mkdir()
    # One intra-op thread: on a shared 2-core runner, OpenMP threads spinning against other processes
    # made the notebooks 5x slower (measured under load); the notebooks' tensors are small anyway.
    env = {
        "MPLBACKEND": "Agg",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), str(NB_DIR), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",
    }
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-Xfrozen_modules=off", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "megamoe notebooks", "language": "python", "env": env,
    }))
    return root


def _execute(name: str, kernel_spec_dir: Path) -> float:
    nb = jupytext.read(NB_DIR / f"{name}.py")
    km = KernelManager(kernel_name="megamoe-nb", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernel_spec_dir)]))
    client = nbclient.NotebookClient(
        nb, km=km, timeout=CELL_TIMEOUT_S, kernel_name="megamoe-nb",
        resources={"metadata": {"path": str(NB_DIR)}},
    )
    t0 = time.perf_counter()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as err:  # the message holds the cell and its traceback
        pytest.fail(f"notebook {name} raised:\n{err}", pytrace=False)
    return time.perf_counter() - t0


@pytest.mark.parametrize("name", _notebooks())
def test_notebook_executes_and_renders(name, kernel_spec_dir):
    fig_dir = NB_DIR / "figures" / name
    if fig_dir.exists():
        for old in fig_dir.glob("*.png"):
            old.unlink()  # only figures written by this run count
    _durations[name] = _execute(name, kernel_spec_dir)
    for fig in EXPECTED_FIGURES.get(name, []):
        path = fig_dir / f"{fig}.png"
        assert path.exists(), f"{name}: figure {fig!r} was not saved to {path}"
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{name}: {path} is not a PNG"
        assert len(data) > MIN_PNG_BYTES, f"{name}: {path} is only {len(data)} bytes (an empty plot?)"
    extra = sorted(p.stem for p in fig_dir.glob("*.png")) if fig_dir.exists() else []
    assert sorted(EXPECTED_FIGURES.get(name, [])) == extra, f"{name}: saved {extra}, expected {EXPECTED_FIGURES.get(name)}"


def test_notebook_06_plots_the_run_the_readme_cites():
    """One name for the cited sweep (bench/results/CITED.json); the README's figure and table point at it."""
    cited = json.loads((REPO / "bench" / "results" / "CITED.json").read_text())
    for key, name in cited.items():
        if key != "about":
            assert (REPO / "bench" / "results" / name).exists(), f"CITED.json {key!r}: {name} does not exist"
    readme = (REPO / "README.md").read_text()
    cited_sweeps = set(re.findall(r"bench/results/(\d{4}-\d{2}-\d{2}_[\w-]+)/sweep\.png", readme))
    assert cited_sweeps == {cited["sweep"]}, (
        f"the README's sweep figure cites {sorted(cited_sweeps)}, bench/results/CITED.json names {cited['sweep']!r}")
    source = (NB_DIR / "06_kernel_walkthrough.py").read_text()
    assert 'cited("sweep")' in source and "rglob" not in source


def test_all_notebooks_within_budget():
    """Runs after the executions (file order); skipped if some notebook was deselected or failed."""
    missing = [n for n in _notebooks() if n not in _durations]
    if missing:
        pytest.skip(f"not all notebooks executed in this session (missing {missing})")
    total = sum(_durations.values())
    report = ", ".join(f"{n} {s:.1f}s" for n, s in _durations.items())
    print(f"notebooks executed in {total:.1f} s: {report}")
    assert total < TOTAL_BUDGET_S, f"notebooks took {total:.0f} s > {TOTAL_BUDGET_S:.0f} s: {report}"


def test_one_colour_per_backend_and_grey_is_the_references_alone():
    """Every registered backend (the headline megamoe-decode-tc included) and a user's has its own colour, never the
    reference's grey; a second process's reading of a backend keeps the backend's colour."""
    from megamoe.fused.registry import BACKENDS
    from megamoe.palette import backend_colour

    colours = {name: backend_colour(name) for name in [*BACKENDS, "reference"]}
    assert len(set(colours.values())) == len(colours), colours
    assert [n for n, c in colours.items() if c == "tab:gray"] == ["reference"]
    assert backend_colour("my-own-kernel") != "tab:gray" and backend_colour("my-own-kernel") not in colours.values()
    assert backend_colour("flashinfer-mxfp4 [p2]") == backend_colour("flashinfer-mxfp4")
