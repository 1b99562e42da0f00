"""Programmatic dependent launch (Hopper) for the decode launches: ``LaunchConfig.pdl``.

A kernel launched with ``launch_pdl=True`` may start while the launch before it is still running, once every
program of that launch has either called ``griddepcontrol.launch_dependents`` (``pdl_release``) or exited.
``griddepcontrol.wait`` (``pdl_wait``) then blocks until the previous launch has finished and its writes are
visible. So each kernel calls ``pdl_wait`` before it reads anything an earlier launch wrote, and ``pdl_release``
where the next launch's early start costs it nothing: route and the combine at once (``pdl_enter``), the
tensor-core gate/up and down after their K loops (a program of the next launch that waits occupies a slot and, on
the H200, slowed gate/up when it sat there for all of gate/up: lab/decode/JOURNAL.md). A program of the
next launch therefore never reads before every program of this one has passed its own wait. Both
instructions are no-ops in a kernel launched without the attribute; under the interpreter nothing is emitted
(``PDL`` False).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def launch_options(warps: int, interpret: bool, pdl: bool = False) -> dict:
    """A decode launch's options: none under the interpreter; warps, and the PDL launch attribute when asked
    (the kernel must then be given PDL=True as well, so that it waits)."""
    if interpret:
        return {}
    return {"num_warps": warps, **({"launch_pdl": True} if pdl else {})}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the previous launch to finish (its writes visible)."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the next launch start (once every program of this one has called this or exited)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """``pdl_wait`` then ``pdl_release``: for the short launches (route, combine)."""
    pdl_wait(PDL)
    pdl_release(PDL)
