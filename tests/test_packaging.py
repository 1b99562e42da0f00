"""Packaging: the sdist holds the whole project, the license is there, the extras use ranges, not pins.

The sdist is built here with setuptools' own PEP 517 hook, in a subprocess without build isolation (no
index needed; about 5 s on 2 cores), and its member list is compared with what git tracks: every
tracked file ships (so an unpacked sdist runs the tests, notebooks and H200 scripts), and nothing
ships that git does not know (figures, executed notebooks, caches).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
# Written by the build itself, not by us.
GENERATED = {"PKG-INFO", "setup.cfg"}
GENERATED_DIRS = ("megamoe.egg-info/",)
# Tracked, deliberately not shipped: the lab (studies, their probes and journals) stays in the repository.
NOT_SHIPPED = {".gitignore"}
NOT_SHIPPED_DIRS = ("lab/",)


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _git_files() -> set[str]:
    """Tracked files plus untracked ones git does not ignore (a new file before its commit), less any virtual
    environment a user made inside the checkout under a name .gitignore does not know (``python3 -m venv v``)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout (e.g. an unpacked sdist): nothing to compare the sdist with")
    tracked = subprocess.run(["git", "ls-files", "--cached", "-z"], cwd=REPO, check=True,
                             capture_output=True).stdout.decode().split("\0")
    untracked = subprocess.run(["git", "ls-files", "--others", "--exclude-standard", "-z"], cwd=REPO, check=True,
                               capture_output=True).stdout.decode().split("\0")
    venvs = {str(p.parent.relative_to(REPO)) + "/" for p in REPO.glob("*/pyvenv.cfg")}
    untracked = [p for p in untracked if not p.startswith(tuple(venvs))] if venvs else untracked
    return {p for p in tracked + untracked if p and (REPO / p).is_file()}


@pytest.fixture(scope="module")
def sdist_files(tmp_path_factory) -> set[str]:
    out = tmp_path_factory.mktemp("sdist")
    code = f"from setuptools.build_meta import build_sdist; print(build_sdist({str(out)!r}))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"sdist build failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    name = proc.stdout.strip().splitlines()[-1]
    with tarfile.open(out / name) as tar:
        members = [m.name for m in tar.getmembers() if m.isfile()]
    root = name.removesuffix(".tar.gz") + "/"
    assert all(m.startswith(root) for m in members), f"members outside {root}: {members[:5]}"
    return {m[len(root):] for m in members}


def test_sdist_ships_every_project_file(sdist_files):
    missing = sorted(p for p in _git_files() - NOT_SHIPPED - sdist_files if not p.startswith(NOT_SHIPPED_DIRS))
    assert not missing, f"{len(missing)} project files are not in the sdist (MANIFEST.in): {missing[:20]}"


def test_sdist_ships_nothing_git_does_not_know(sdist_files):
    extra = sorted(p for p in sdist_files - _git_files() - GENERATED if not p.startswith(GENERATED_DIRS))
    assert not extra, f"{len(extra)} files in the sdist that git does not track: {extra[:20]}"


def test_sdist_has_what_its_own_tests_read(sdist_files):
    """Independent of git: the files an unpacked sdist needs for its notebook test and the README."""
    cited = (REPO / "bench" / "results" / "CITED.json")
    need = {"LICENSE", "README.md", "pyproject.toml", "tests/test_notebooks.py", "notebooks/_nb.py",
            "notebooks/_kernel_walkthrough.py",
            "notebooks/06_kernel_walkthrough.py", "docs/kernel-contract.md", "docs/quickstart.md",
            "bench/results/CITED.json", "bench/results/2026-12-02-h200-dg-probe.json", "scripts/test.sh"}
    if cited.exists():  # the JSON of every cited results folder (notebooks and tests read them)
        for run in json.loads(cited.read_text()).values():
            if isinstance(run, str) and (REPO / "bench" / "results" / run).is_dir():
                need |= {f"bench/results/{run}/{p.name}" for p in (REPO / "bench" / "results" / run).glob("*.json")}
    assert not sorted(need - sdist_files), f"sdist lacks {sorted(need - sdist_files)}"
    assert not [p for p in sdist_files if p.endswith((".pyc", ".ipynb")) or p.startswith("notebooks/figures/")]


def test_no_lab_file_ships(sdist_files):
    """The lab is the repository's, not the package's: no lab/ file in the sdist, and no lab package among those
    setuptools puts in the wheel (the same ``packages.find`` rule the wheel build reads from pyproject.toml)."""
    from setuptools import find_packages

    assert not [p for p in sdist_files if p.startswith("lab/")], "lab/ files in the sdist (MANIFEST.in: prune lab)"
    find = _pyproject()["tool"]["setuptools"]["packages"]["find"]
    wheel_packages = find_packages(where=str(REPO), include=find["include"], exclude=find.get("exclude", ()))
    assert "megamoe.decode" in wheel_packages  # the rule finds packages at all
    assert not [p for p in wheel_packages if not p.startswith("megamoe")], wheel_packages
    assert (REPO / "lab" / "__init__.py").exists() or not (REPO / "lab").exists()  # lab is a package the rule skips


def test_license_file_matches_the_metadata():
    meta = _pyproject()["project"]
    assert meta["license"] == "Apache-2.0"
    assert meta["license-files"] == ["LICENSE"]
    head = (REPO / "LICENSE").read_text()[:400]
    assert "Apache License" in head and "Version 2.0, January 2004" in head


def test_requirements_are_ranges_that_the_cpu_install_satisfies():
    """No `==` pin anywhere (a pin would move packages inside an existing vLLM / SGLang environment);
    the GPU kernel packages have an upper bound too (their APIs change between minor releases); the
    README's `torch==2.13.0` satisfies the torch range; numpy is a core dependency (torch warns without it)."""
    meta = _pyproject()["project"]
    reqs = {"core": [Requirement(r) for r in meta["dependencies"]]}
    reqs |= {name: [Requirement(r) for r in rs] for name, rs in meta["optional-dependencies"].items()}
    for extra, rs in reqs.items():
        for r in rs:
            assert not any(s.operator in ("==", "===") for s in r.specifier), f"[{extra}] {r} is a pin"
            assert str(r.specifier), f"[{extra}] {r.name} has no version range at all"
    torch_req = next(r for r in reqs["core"] if r.name == "torch")
    assert torch_req.specifier.contains("2.13.0"), torch_req
    assert "numpy" in {r.name for r in reqs["core"]}
    for r in reqs["fused"]:
        assert any(s.operator in ("<", "<=") for s in r.specifier), f"[fused] {r} has no upper bound"
    assert {"triton", "flashinfer-python", "sgl-deep-gemm", "apache-tvm-ffi"} <= {r.name for r in reqs["fused"]}
    assert {"jupyterlab", "nbconvert", "jupytext", "nbclient", "ipykernel", "matplotlib"} <= {
        r.name for r in reqs["notebooks"]}
    assert "matplotlib" in {r.name for r in reqs["plot"]}


def test_tested_versions_are_stated_in_the_docs():
    """The versions the H200 results were taken with, in docs/quickstart.md, each inside its extra's range."""
    text = (REPO / "docs" / "quickstart.md").read_text()
    fused = {Requirement(r).name: Requirement(r) for r in _pyproject()["project"]["optional-dependencies"]["fused"]}
    tested = {"flashinfer-python": "0.7.4", "sgl-deep-gemm": "0.1.5.post1", "apache-tvm-ffi": "0.1.11",
              "triton": "3.6.0"}
    for name, version in tested.items():
        assert f"{name} {version}" in text, f"docs/quickstart.md does not state the tested {name} {version}"
        assert fused[name].specifier.contains(version), f"tested {name} {version} is outside {fused[name]}"


def test_the_test_extra_brings_the_tested_triton():
    """`pip install -e ".[test]"` must give a Triton whose interpreter passes (3.6.0; 3.9's fails 29 tests with
    "mask has unsupported dtype"), not whatever is newest; and the setuptools the sdist test builds with."""
    test = {Requirement(r).name: Requirement(r) for r in _pyproject()["project"]["optional-dependencies"]["test"]}
    assert test["triton"].specifier.contains("3.6.0") and not test["triton"].specifier.contains("3.9.0")
    assert {"pytest", "pytest-benchmark", "setuptools"} <= set(test)
    build = Requirement(_pyproject()["build-system"]["requires"][0])
    assert build.name == "setuptools" and str(test["setuptools"].specifier) == str(build.specifier)


def test_the_metadata_says_who_and_what():
    meta = _pyproject()["project"]
    assert meta["authors"] and meta["keywords"]
    assert "Programming Language :: Python :: 3.11" in meta["classifiers"]
    assert any(c.startswith("Topic ::") for c in meta["classifiers"])


def _readme_commands() -> list[str]:
    """The command lines of README.md's first bash block."""
    block = re.search(r"^```bash\n(.*?)^```$", (REPO / "README.md").read_text(), re.M | re.S)
    assert block, "README.md has no bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_ci_runs_exactly_the_readme_commands():
    """.ci/run runs the README's two commands, written there as README.md's first bash block shows them, and
    nothing else: no install or test step of its own that the README does not say."""
    readme = _readme_commands()
    assert len(readme) == 2, f"README.md's first bash block holds {len(readme)} command lines, expected two"
    install, tests = readme
    assert install.startswith("pip install torch==2.13.0 -e . &&") and install.endswith("megamoe check")
    assert tests == 'pip install torch==2.13.0 -e ".[test,notebooks]" && python3 -m pytest -q'
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert [line for line in ci if "pip " in line or "pytest" in line] == readme, "a step of .ci/run's own"
    assert "set -euxo pipefail" in ci  # a failing command (pytest's exit 5 for no tests, too) fails CI


def _load_provenance_copy(folder: Path):
    """megamoe/provenance.py copied to FOLDER/megamoe/ and loaded from there (what a vendored copy would run)."""
    import importlib.util

    (folder / "megamoe").mkdir(parents=True)
    shutil.copy(REPO / "megamoe" / "provenance.py", folder / "megamoe" / "provenance.py")
    spec = importlib.util.spec_from_file_location("provenance_copy", folder / "megamoe" / "provenance.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_commit_is_megamoes_own_never_a_surrounding_repositorys(tmp_path):
    def git(cwd, *args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                              capture_output=True, text=True).stdout.strip()

    other = tmp_path / "other-project"
    other.mkdir()
    git(other, "init", "-q")
    (other / "README").write_text("another project\n")
    git(other, "add", "README")
    git(other, "commit", "-qm", "theirs")
    vendored = _load_provenance_copy(other / "vendor")  # megamoe copied inside another repository
    assert git(other, "rev-parse", "HEAD") and vendored.package_git("rev-parse", "HEAD") == ""
    own = tmp_path / "megamoe-checkout"
    mine = _load_provenance_copy(own)
    git(own, "init", "-q")
    git(own, "add", ".")
    git(own, "commit", "-qm", "ours")
    assert mine.package_git("rev-parse", "HEAD") == git(own, "rev-parse", "HEAD")
