"""Adversarial inputs, as a table by category: every entry point refuses clearly (naming the argument, the
expected and the actual value), repairs exactly (checked by an independent decode), or computes the right
answer (checked against an independent computation). No silent corruption, no unflagged NaN.

The audit behind it found, among others: (1) E8M0 0xFF treated as 2**128, (2) no lower bound on the
DeepGEMM SM90 FP4 window, (3) ranks never agreeing on their setup, (4) ``stage_into`` writing bad expert
ids, (5) NaN / negative parameters accepted; each has its cases (``finding``), and so has each of the
smaller ones ("also-..."). Types, independent decoders and helpers: ``adversarial_support.py``.
"""

from __future__ import annotations

import re

import pytest

from adversarial_decode import DECODE, IN_PLACE, MESSAGES, ORDER, STRIDED
from adversarial_inputs import ACTIVATIONS, GEOMETRY, ROUTING, STAGING
from adversarial_support import E2M1, Refused, independent_table
from adversarial_system import BACKEND, CHECKPOINTS, CLI, DISTRIBUTED
from adversarial_weights import SCALE
from megamoe.formats import WEIGHT_DECODERS, exact_scale_bytes, mxfp4_decode_table, scale_byte_window
from megamoe.recipe import RECIPES

# ------------------------------------------------------------------------------------ the tests
CASES = (SCALE + ACTIVATIONS + ROUTING + GEOMETRY + BACKEND + STAGING + CHECKPOINTS + DISTRIBUTED + CLI + DECODE + IN_PLACE
         + STRIDED + MESSAGES + ORDER)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_case(case, weights_for):
    if isinstance(case.expect, Refused):
        with pytest.raises(case.expect.error) as info:
            case.run(weights_for)
        msg = str(info.value)
        assert re.search(case.expect.pattern, msg, re.S), f"{case.id}: the message does not say it:\n{msg}"
        if case.expect.check is not None:
            case.expect.check(msg, weights_for)
    else:  # Exact or Correct: no exception, and the result checks out against the independent computation
        case.expect.check(case.run(weights_for))


def test_table_covers_every_finding_and_category():
    findings = {c.finding for c in CASES}
    assert {"1", "2", "3", "4", "5"} <= findings
    assert {"also-fp8-scale", "also-bf16-max", "also-subnormal", "also-int", "also-ckpt"} <= findings
    counts = {cat: sum(c.category == cat for c in CASES) for cat in dict.fromkeys(c.category for c in CASES)}
    print("\ncases per category:", counts, "total", len(CASES))
    assert len({c.id for c in CASES}) == len(CASES), "case names must be unique"


# ------------------------------------------------------------------------------------ the windows, byte by byte
@pytest.mark.parametrize("decode", list(WEIGHT_DECODERS))
def test_decode_table_matches_an_independent_decode(decode):
    """All 256 bytes x 16 codes of each decode rule against the rule written out here."""
    ours = mxfp4_decode_table(WEIGHT_DECODERS[decode]).view(256, 16).tolist()
    theirs = independent_table(decode)
    for b in range(256):
        for c in range(16):
            a, t = ours[b][c], theirs[b][c]
            assert (a == t) or (a != a and t != t), f"{decode}: byte {b} code {c}: {a} vs {t}"


@pytest.mark.parametrize("decode", list(WEIGHT_DECODERS))
def test_windows_derived_from_the_decode_rule(decode):
    """A byte is legal iff all 16 codes decode exactly; the window is what that gives, and 0xFF never is."""
    theirs = independent_table(decode)
    legal = [b for b in range(256) if all(theirs[b][c] == math_value(b, c) for c in range(16))]
    assert tuple(legal) == exact_scale_bytes(decode)
    assert scale_byte_window(decode) == (legal[0], legal[-1]) and 255 not in legal
    assert {"exact": (0, 252), "e4m3_flush_saturate": (122, 133), "e4m3_rn": (119, 133),
            "e4m3_group": (20, 236)}[decode] == (legal[0], legal[-1])


def math_value(b, c):
    return (-1.0 if c & 8 else 1.0) * E2M1[c & 7] * 2.0 ** (b - 127)


@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_windows_agree_with_the_derivation(name):
    r = RECIPES[name]
    want = scale_byte_window(r.weight_decode) if r.weight_format == "mxfp4" else (None, None)
    assert (r.min_scale_byte, r.max_scale_byte) == want
    with pytest.raises(ValueError, match="init=False"):
        r.with_(min_scale_byte=0)  # a window is derived, never set by hand

