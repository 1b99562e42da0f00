"""The package's shape: no import circles (lazy imports inside functions count too), no import of the
repository's lab/ or tests/ (the package is what users install; those are not in it), and every module imports on
a CPU. Modules are split by concept, not by length: no line cap.

The graph is read statically from the source (``ast``): an edge m -> n for every ``import`` / ``from ... import``
in m, at any depth, that names a megamoe module n. ``from .pkg import name`` is an edge to ``pkg.name`` when
that is a module, else to ``pkg`` itself."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "megamoe"
OUTSIDE = ("lab", "tests")  # top-level names of the repository's folders the package must not import


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(mod: str, is_pkg: bool, level: int, target: str | None) -> str:
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node.level, node.module) if node.level else (node.module or "")
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for n in names:
                while n and n not in mods:  # import megamoe.x.y.attr -> the module that holds it
                    n = n.rpartition(".")[0]
                if n and n != mod and n.startswith("megamoe"):
                    graph[mod].add(n)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_walk_finds_a_circle_when_there_is_one():
    g = {"megamoe.a": {"megamoe.b"}, "megamoe.b": {"megamoe.c"}, "megamoe.c": {"megamoe.a"}, "megamoe.d": {"megamoe.a"}}
    assert cycles(g) == [["megamoe.a", "megamoe.b", "megamoe.c"]]
    graph = import_graph()
    assert "megamoe.fused.base" in graph["megamoe.fused.registry"]  # edges are read at all
    assert "megamoe.inputs" in graph["megamoe.fused.base"]


def test_no_import_circles():
    found = cycles(import_graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def outside_imports(source: str) -> list[str]:
    """Every absolute import in ``source`` (at any depth) of lab/ or tests/, as written, and every
    ``importlib.import_module`` / ``__import__`` of them by a literal name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            fn = node.func
            if (getattr(fn, "attr", None) == "import_module" or getattr(fn, "id", None) in ("__import__", "import_module")):
                names = [str(node.args[0].value)]
        found += [n for n in names if n.split(".")[0] in OUTSIDE]
    return found


def test_the_outside_walk_finds_imports_of_lab_and_tests():
    src = ("import lab.cuda_step.ab\ndef f():\n    from tests.conftest import tiny\n    import importlib\n"
           "    importlib.import_module('lab.decode')\nimport labels\nfrom .lab import x\n")
    assert outside_imports(src) == ["lab.cuda_step.ab", "tests.conftest", "lab.decode"]


def test_the_package_never_imports_lab_or_tests():
    found = {m: names for m, p in modules().items() if (names := outside_imports(p.read_text()))}
    assert not found, f"megamoe modules importing the repository's lab/ or tests/: {found}"


def reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others (lazy imports included)."""
    seen, todo = set(), [start]
    while todo:
        for n in graph[todo.pop()] - seen:
            seen.add(n)
            todo.append(n)
    return seen


def test_the_reach_walk_follows_imports_through_other_modules():
    g = {"megamoe.a": {"megamoe.b"}, "megamoe.b": {"megamoe.c"}, "megamoe.c": set(), "megamoe.d": {"megamoe.a"}}
    assert reaches(g, "megamoe.a") == {"megamoe.b", "megamoe.c"} and reaches(g, "megamoe.c") == set()


def test_check_never_imports_bench():
    """``megamoe check`` checks; ``megamoe bench`` times. The check's run metadata is megamoe.provenance's, its
    launch column times with torch's CUDA events: no module of megamoe.check reaches megamoe.bench, even lazily."""
    graph = import_graph()
    found = {m: sorted(n for n in reaches(graph, m) if n == "megamoe.bench" or n.startswith("megamoe.bench."))
             for m in graph if m == "megamoe.check" or m.startswith("megamoe.check.")}
    found = {m: b for m, b in found.items() if b}
    assert not found, f"megamoe.check modules reaching megamoe.bench: {found}"


OPTIONAL = {"triton", "matplotlib", "flashinfer", "deep_gemm"}  # extras a CPU install may lack


@pytest.mark.parametrize("name", sorted(m for m in modules() if m != "megamoe.__main__"))  # that one runs the CLI
def test_every_module_imports_on_a_cpu(name):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name not in OPTIONAL:
            raise
        pytest.skip(f"{name} needs {exc.name}, which is not installed")


def test_the_cli_and_the_registry_import_without_triton():
    """``megamoe check`` (the README's first command) installs no triton: the registry, the backends' classes and
    both CLIs must import with triton absent (it is blocked here, as a machine without it has none)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['triton'] = None\n"
            "import megamoe.fused.registry, megamoe.check.cli, megamoe.bench.cli, megamoe.cli\n"
            "from megamoe.fused.registry import BACKENDS; assert 'megamoe-decode' in BACKENDS\n"
            "assert BACKENDS['megamoe-decode'].max_tokens_per_rank == 64\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
