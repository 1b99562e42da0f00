"""The docs stand alone: every repository path they name exists, none points outside the repository,
and the quick start's Python runs as written on a CPU (blocks marked `# H200 only` are skipped). The lab's index
(lab/README.md) is held to the same rule; its journals only to the first half (they name runs that git history
keeps)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [*sorted((REPO / "docs").glob("*.md")), REPO / "lab" / "README.md"]
JOURNALS = sorted((REPO / "lab").glob("*/JOURNAL.md"))
TOP_DIRS = ("megamoe", "bench", "docs", "notebooks", "tests", "scripts", ".ci", "lab")


def test_docs_exist():
    names = {p.name for p in DOCS}
    assert {"quickstart.md", "kernel-contract.md", "kernel-numerics.md"} <= names, names


def outside_paths(text: str) -> list[str]:
    """Paths that climb out of the repository or name an absolute path on some machine (URLs are fine)."""
    return re.findall(r"(?<![\w:/.])(?:\.\./|/[A-Za-z_][\w.-]*/)[\w./-]*", text)


@pytest.mark.parametrize("journal", JOURNALS, ids=lambda p: p.parent.name)
def test_no_journal_points_outside_the_repository(journal):
    assert len(JOURNALS) >= 5
    assert not outside_paths(journal.read_text()), f"{journal} points outside the repository"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_a_doc_names_is_in_the_repository(doc):
    text = doc.read_text()
    # Nothing climbs out of the repository or names an absolute path on some machine ...
    outside = outside_paths(text)
    assert not outside, f"{doc.name} points outside the repository: {outside}"
    # ... and every markdown document it cites is one of the repository's own.
    cited = set(re.findall(r"`([\w./-]+\.md)`", text))
    foreign = sorted(m for m in cited if not any((REPO / d / m).exists() for d in ("", "docs", "bench/results")))
    assert not foreign, f"{doc.name} cites documents the repository does not have: {foreign}"
    paths = set(re.findall(r"`((?:%s)/[\w./*-]+)`" % "|".join(map(re.escape, TOP_DIRS)), text))
    assert paths, f"{doc.name} names no repository path (the regex is broken?)"
    missing = sorted(p for p in paths if not (list(REPO.glob(p)) if "*" in p else (REPO / p.rstrip("/")).exists()))
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


def test_quickstart_python_runs_on_a_cpu():
    from megamoe.fused.registry import BACKENDS, BUILTIN

    text = (REPO / "docs" / "quickstart.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    runnable = [b for b in blocks if not b.startswith("# H200 only")]
    assert len(runnable) >= 5 and len(blocks) > len(runnable)
    scope: dict = {}
    try:
        for block in runnable:
            exec(compile(block, "docs/quickstart.md", "exec"), scope)  # noqa: S102 - our own doc
    finally:
        for name in set(BACKENDS) - BUILTIN:
            del BACKENDS[name]
    assert [r["status"] for r in scope["rows"]] == ["pass", "pass"]
    assert scope["t"].median_us > 0
