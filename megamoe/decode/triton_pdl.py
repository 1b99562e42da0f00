"""Programmatic dependent launch (Hopper) for the decode launches: ``LaunchConfig.pdl``.

A kernel launched with ``launch_pdl=True`` may start while the launch before it is still running, once every
program of that launch has either signalled ``griddepcontrol.launch_dependents`` or exited.
``griddepcontrol.wait`` then blocks until the previous launch has finished and its writes are visible. So each
kernel calls ``pdl_enter`` before it reads anything an earlier launch wrote: it waits, then lets the next
launch start. Programs of the next launch are therefore only ever started once every program of this one has
passed its own wait, and they spend their head start on their own wait (or on hints that change no bit, such
as the tensor-core L2's cache prefetch). Both instructions are no-ops in a kernel launched without the
attribute; under the interpreter nothing is emitted (``PDL`` False).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the previous launch to finish (its writes visible), then let the next launch start."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
