"""A CPU backend whose kernel is the eager reference, for tests of the backend interface (``test_block_m.py``,
``test_external_backend.py``).

``ToyBackend`` is a whole ``FusedBackend`` on one rank (``OneRank``), always available, on the CPU: legal BLOCK_Ms
8 and 16, a plan of the BLOCK_M asked (8 by default), weights and inputs kept as given, and a launch that returns
``moe_forward`` of them in the recipe flashinfer-mxfp4, so every case passes bit for bit at any BLOCK_M. A test
subclasses it with a ``name`` and the hooks it looks at (recording what they were handed, or old-style signatures).
"""

from __future__ import annotations

import torch

from megamoe.fused.base import FusedBackend, Plan
from megamoe.fused.external import OneRank
from megamoe.recipe import get_recipe
from megamoe.reference import moe_forward


class ToyBackend(FusedBackend):
    recipe = get_recipe("flashinfer-mxfp4")

    def __init__(self, geometry, **kw):
        super().__init__(geometry, group=OneRank(), **{k: v for k, v in kw.items() if k != "group"})

    @classmethod
    def availability(cls):
        return True, ""

    @property
    def device(self):
        return torch.device("cpu")

    def legal_block_ms(self, num_tokens=None):
        return (8, 16)

    def plan(self, num_tokens, block_m=None):
        return Plan(block_m=block_m or 8, forced=block_m is not None)

    def _prepare(self, weights):
        self.kernel_weights = weights

    def _allocate(self):
        pass

    def _stage(self, inputs, m):
        self.staged = inputs

    def launch(self, num_tokens, block_m=None):
        return moe_forward(self.staged, self.kernel_weights, self.recipe, self.g)  # no tile: the same bits at any
