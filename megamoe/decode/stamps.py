"""The tensor-core decode launches' timeline, switched on from outside: a caller sets ``DecodeBuffers.stamps`` to
``stamp_buffer(buf, programs)`` before it launches (or captures) the step, and each program of the gate/up and the
down launch stores when it reached each point (``triton_tc_ops._stamp``); ``None`` turns it off again. The lab reads
the buffer (lab/decode/timeline.py).

    stamps int64 [2, P, 16]   per launch (0 gate/up, 1 down) and program: the SM id in word 0; for each point k
                              (``POINTS``) the GPU's %globaltimer (ns, one clock for every SM) in word k and the
                              SM's %clock64 (cycles) in word 8 + k; -1 where a program never reached a point

The points, in both launches: 1 start, 2 past ``griddepcontrol.wait``, 3 work item known (the gate/up launch: after
its own route when it routes for itself), 4 K loop done, 5 exit; a program past the step's work items records 1, 2
and 5 only. Recording costs a few stores per program:
time the launch without it too.
"""

from __future__ import annotations

import torch

POINTS = {1: "start", 2: "waited", 3: "item", 4: "loop done", 5: "exit"}
LAUNCHES = ("l1", "l2")  # the gate/up launch, the down launch
WORDS = 16  # int64 per program: SM id, 7 timer words, 8 clock words


def stamp_buffer(buf, programs: int) -> torch.Tensor:
    """int64 [2, programs, 16] filled with -1 (a point no program reached stays -1), on the buffers' device."""
    return torch.full((len(LAUNCHES), programs, WORDS), -1, dtype=torch.int64, device=buf.x_q.device)
