"""BLOCK_M is an argument of each call, and a backend that cannot honour one refuses it before anything runs.

Every registered backend is asked, at every entry point whose plan depends on BLOCK_M, for values it cannot run:
a ValueError naming ``block_m``, the legal values and the value given, raised while the backend is neither prepared
nor allocated (so any later step would have failed otherwise). The values it can run must reach its hooks: spies
record what ``plan`` / ``build_jobs`` / ``launch`` were handed, so a backend that accepts a BLOCK_M and runs its own
plan fails here, and so does a subclass whose hooks take no ``block_m`` (it is refused, not run).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from megamoe.bench.backends import FusedBench
from megamoe.check.matrix import Case, run_matrix
from megamoe.fused.base import Plan
from megamoe.fused.registry import BACKENDS, BUILTIN
from megamoe.geometry import get_geometry
from megamoe.inputs import make_inputs
from megamoe.reference import moe_forward

from toy_backend import ToyBackend

TINY = get_geometry("tiny")
CAPACITY = 8


def _refusal(be, bad: int) -> str:
    """The words a refusal of ``bad`` must hold: the argument, the legal values and the value given."""
    legal = tuple(be.legal_block_ms())
    if legal:
        return rf"{re.escape(be.name)}: block_m must be one of {re.escape(str(legal))} \(or None\), got {bad}$"
    return rf"{re.escape(be.name)}: block_m must be None, its tile is fixed \(.+\): legal values \(\), got {bad}$"


ENTRY_POINTS = {
    "plan": lambda be, bm: be.plan(1, bm),
    "build_jobs": lambda be, bm: be.build_jobs([1, 7], bm),
    "build": lambda be, bm: be.build([1, 7], block_m=bm),
    "launch": lambda be, bm: be.launch(1, bm),
    "run": lambda be, bm: be.run(make_inputs(TINY, 1, seed=0), block_m=bm),
    "bench view": lambda be, bm: FusedBench(type(be), TINY, CAPACITY).with_block_m(bm),
    "bench backend": lambda be, bm: FusedBench(type(be), TINY, CAPACITY, block_m=bm),
}


def _bad_values(be) -> list[int]:
    """A value no backend lists, and for a fixed tile every value anyone might think it runs (its old (16,) too)."""
    legal = tuple(be.legal_block_ms())
    return [7] if legal else [7, 8, 16, 64]


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_every_backend_refuses_a_block_m_it_cannot_honour(name, entry):
    be = BACKENDS[name](TINY, capacity=CAPACITY)
    for bad in _bad_values(be):
        with pytest.raises(ValueError, match=_refusal(be, bad)):
            ENTRY_POINTS[entry](be, bad)


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_the_constructor_refuses_it_too_and_a_fixed_tile_says_what_fixes_it(name):
    cls = BACKENDS[name]
    be = cls(TINY, capacity=CAPACITY)
    if not be.legal_block_ms():
        assert be.fixed_tile, f"{name}: a fixed tile must say what fixes it (FusedBackend.fixed_tile)"
    for bad in _bad_values(be):
        with pytest.raises(ValueError, match=_refusal(be, bad).replace("block_m must", "force_block_m must")):
            cls(TINY, capacity=CAPACITY, force_block_m=bad)
    with pytest.raises(TypeError, match="block_m must be an int, got float 8.0"):
        be.plan(1, 8.0)


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_a_backend_that_lists_block_ms_takes_block_m_in_every_hook(name):
    """Listing a BLOCK_M and having a hook that cannot be handed it is how a choice gets dropped (megamoe-decode-tc
    listed (16,), accepted 16 and ran its own launch config): the lists and the hooks must agree."""
    be = BACKENDS[name](TINY, capacity=CAPACITY)
    assert not (be.legal_block_ms() and be._hooks_without_block_m), (be.legal_block_ms(), be._hooks_without_block_m)


def test_force_block_m_is_fixed_at_construction():
    be = BACKENDS["megamoe-decode"](TINY, capacity=CAPACITY, force_block_m=2)
    with pytest.raises(AttributeError, match="force_block_m is fixed at construction.*pass block_m= to plan"):
        be.force_block_m = 4
    assert be.force_block_m == 2 and be.plan(1).block_m == 2 and be.plan(1, 4).block_m == 4


# ------------------------------------------------------------------------------------ the legal values reach the hooks
def test_megamoe_decode_launches_the_block_m_it_is_given(monkeypatch):
    import megamoe.decode as decode

    be = BACKENDS["megamoe-decode"](TINY, capacity=CAPACITY)
    seen = []
    monkeypatch.setattr(decode, "moe_decode", lambda dw, buf, m, clamp, cfg: seen.append(cfg.block_m))
    be.dw = be.buf = None  # the spy reads neither
    for bm in (None, *be.legal_block_ms()):
        be.launch(1, bm)
        assert be.plan(1, bm).block_m == (bm or 1) and be.plan(1, bm).forced == (bm is not None)
        assert {k[1][2].block_m for k in be.build_jobs([1, 7], bm)} == {bm or 1}
    assert seen == [1, 1, 2, 4]


def test_flashinfer_launches_the_plan_of_the_block_m_it_is_given(monkeypatch):
    """FlashInfer's selector and launcher replaced by spies: the FusedPlan handed to the kernel has the BLOCK_M
    asked, and ``intermediates`` reports the launched one."""
    import megamoe.fused.flashinfer_mxfp4 as fi

    @dataclasses.dataclass(frozen=True)
    class FusedPlan:  # the fields kernel_plan replaces (flashinfer.megamoe's plan has more)
        block_m: int = 8
        swap_ab: bool = True
        rs_swap_ab: bool = True
        num_stages: int = 8
        single_active_dispatch_warp: bool = True

    launched = []

    class FakeModule:
        gen_megamoe_sm90_mxfp4_module = None

        @staticmethod
        def _run_kernel(factory, kernel, p, y, *args):
            launched.append(p.block_m)

    monkeypatch.setattr(fi, "_import", lambda: FakeModule)
    be = BACKENDS["flashinfer-mxfp4"](TINY, capacity=CAPACITY)
    monkeypatch.setattr(be, "_select", lambda m: FusedPlan())
    be.buf, be.y, be.l1 = type("Buf", (), {"num_sms": 132})(), torch.empty(CAPACITY, TINY.hidden), None
    be.l2 = be.gs1 = be.gs2 = None
    be._prepared = be._allocated = True
    for bm in (None, *be.legal_block_ms()):
        be.launch(1, bm)
        assert be._launched_block_m == (bm or 8) == be.plan(1, bm).block_m
        assert {k[1].block_m for k in be.build_jobs([1, 7], bm)} == {bm or 8}
    assert launched == [8, 8, 24, 64]


# ------------------------------------------------------------------------------------ a subclass's hooks
class _Toy(ToyBackend):
    """The CPU toy (its kernel the reference; legal BLOCK_Ms 8 and 16), recording what each hook was handed."""

    name = "toy-block-m"

    def __init__(self, geometry, **kw):
        super().__init__(geometry, **kw)
        self.seen = []

    def plan(self, num_tokens, block_m=None):
        self.seen.append(("plan", block_m))
        return super().plan(num_tokens, block_m)

    def _build_job(self, num_tokens, block_m=None):
        self.seen.append(("build", block_m))
        return (block_m,), (lambda: None)

    def launch(self, num_tokens, block_m=None):
        self.seen.append(("launch", block_m))
        return super().launch(num_tokens, block_m)


class _DeafToy(_Toy):
    """The same, written before BLOCK_M was an argument: its hooks read ``self.force_block_m`` alone."""

    name = "toy-block-m-deaf"

    def plan(self, num_tokens):
        return Plan(block_m=self.force_block_m or 8, forced=self.force_block_m is not None)

    def _build_job(self, num_tokens):
        return (self.force_block_m,), (lambda: None)

    def launch(self, num_tokens):
        self.seen.append(("launch", self.force_block_m))
        return moe_forward(self.staged, self.kernel_weights, self.recipe, self.g)


def test_the_matrix_hands_each_case_its_block_m(registered):
    registered(_Toy)
    rows = run_matrix(_Toy.name, [Case("tiny", 5, seed=1), Case("tiny", 5, block_m=16, seed=1)], repeats=1,
                      log=lambda *a: None)
    assert [r["status"] for r in rows] == ["pass", "pass"], rows
    assert [r["plan"] for r in rows] == ["BLOCK_M 8", "BLOCK_M 16 (forced)"]


def test_a_case_the_backend_cannot_honour_stops_the_matrix_before_anything_runs(registered, monkeypatch):
    registered(_Toy)
    made = []
    monkeypatch.setattr("megamoe.check.matrix._weights", lambda *a: made.append(a) or pytest.fail("weights made"))
    with pytest.raises(ValueError, match=r"toy-block-m: block_m must be one of \(8, 16\) \(or None\), got 24"):
        run_matrix(_Toy.name, [Case("tiny", 5, seed=1), Case("tiny", 5, block_m=24, seed=1)], log=lambda *a: None)
    assert not made


def test_hooks_that_take_no_block_m_refuse_one_rather_than_drop_it(registered):
    be = _DeafToy(TINY, capacity=CAPACITY)
    w = __import__("megamoe.weights", fromlist=["x"]).random_mxfp4_weights(TINY, seed=0)
    be.prepare_weights(w)
    why = r"toy-block-m-deaf: block_m=16 would be ignored: its plan, _build_job, launch take no block_m argument"
    for entry in ("plan", "build_jobs", "launch", "run"):
        with pytest.raises(ValueError, match=why):
            ENTRY_POINTS[entry](be, 16)
    assert be.seen == []  # nothing launched
    registered(_DeafToy)
    with pytest.raises(ValueError, match=why):
        run_matrix(_DeafToy.name, [Case("tiny", 5, block_m=16, seed=1)], log=lambda *a: None)
    # The instance default still reaches it (its hooks read force_block_m), and so does None, the plan's own
    pinned = _DeafToy(TINY, capacity=CAPACITY, force_block_m=16)
    pinned.prepare_weights(w)
    pinned.run(make_inputs(TINY, 3, seed=2))
    assert pinned.plan(3).block_m == 16 and pinned.seen == [("launch", 16)]
