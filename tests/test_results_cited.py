"""bench/results/ holds only what the text cites: CITED.json names every kept folder or file, every name it holds
exists, each is cited by the README, bench/README.md, the docs or the notebooks, and no trace (.pt) is kept
(superseded runs and traces stay in git history)."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
MAX_BYTES = 15 * 2**20  # the folder's budget: what a clone and an sdist carry


def _cited() -> dict[str, str]:
    return {k: v for k, v in json.loads((RESULTS / "CITED.json").read_text()).items() if k != "about"}


def _text() -> str:
    """Everything that may cite a run: the README, bench/README.md, the docs, the notebooks."""
    files = [REPO / "README.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted((REPO / "notebooks").glob("*.py")), *sorted((REPO / "notebooks").glob("*.md"))]
    return "\n".join(f.read_text() for f in files)


def uncited(kept: set[str], cited: dict[str, str], text: str) -> dict[str, list[str]]:
    """What is wrong between the folder's entries, CITED.json and the text (empty lists when nothing is)."""
    names = set(cited.values())
    return {"kept, not in CITED.json": sorted(kept - names),
            "in CITED.json, not kept": sorted(names - kept),
            "in CITED.json, cited by no text": sorted(n for n in names if n not in text),
            "named twice in CITED.json": sorted(n for n in names if list(cited.values()).count(n) > 1)}


def test_the_check_finds_each_kind_of_mismatch():
    cited = {"a": "run-a", "b": "run-b", "c": "run-c", "d": "run-a"}
    assert uncited({"run-a", "run-b", "run-x"}, cited, "see run-a and run-c") == {
        "kept, not in CITED.json": ["run-x"], "in CITED.json, not kept": ["run-c"],
        "in CITED.json, cited by no text": ["run-b"], "named twice in CITED.json": ["run-a"]}


def test_every_kept_entry_is_cited_and_every_cited_one_is_kept():
    kept = {p.name for p in RESULTS.iterdir() if p.name != "CITED.json"}
    problems = {k: v for k, v in uncited(kept, _cited(), _text()).items() if v}
    assert not problems, problems


def test_no_traces_and_under_budget():
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    assert not [p for p in files if p.suffix == ".pt"], "traces (.pt) belong in git history, not in bench/results"
    total = sum(p.stat().st_size for p in files)
    assert total < MAX_BYTES, f"bench/results holds {total / 2**20:.1f} MiB, over {MAX_BYTES / 2**20:.0f}"


def test_the_readme_table_is_the_cited_sweeps():
    """The README's results table is ``bench/readme_table.py`` on the sweep CITED.json names, line for line."""
    import importlib.util

    from megamoe.bench.tables import load_results

    spec = importlib.util.spec_from_file_location("readme_table", REPO / "bench" / "readme_table.py")
    readme_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(readme_table)
    made = readme_table.table(load_results(RESULTS / _cited()["sweep"])).splitlines()
    readme = (REPO / "README.md").read_text().splitlines()
    assert made[0] in readme, "the README holds no table with the header bench/readme_table.py writes"
    at = readme.index(made[0])
    assert readme[at:at + len(made)] == made
