"""megamoe's own small-batch FP8 x MXFP4 MoE path (1..64 tokens per rank), weights streamed once per step in a
layout prepared once, in two variants that round differently:

    DecodeWeights (layout.py, triton_gemv.py)   exact float64 block sums on CUDA cores   recipe megamoe-decode
    TCWeights (layout_tc.py, triton_tc.py)      an FP8 MMA per 32-K scale group          recipe megamoe-decode-tc

``moe_decode`` runs whichever weights it is given. Each Triton stage sits beside its torch twin (same name +
``_torch``, same signature). Names: gate/up is the gate/up GEMM (with SwiGLU, the routing weight and the FP8
requant) and down the down GEMM, ``l1_*`` / ``l2_*`` in the public names (fields, launchers, kernels); L1 and L2
alone are the GPU's caches. Design, napkin math and the H200 runs: docs/decode-kernel.md (CUDA cores) and
docs/decode-kernel-tc.md (tensor cores)."""

from .gemv import LaunchConfig
from .layout import DecodeWeights, TileShape, checkpoint_from_decode, prepare_decode_weights
from .layout_tc import TCWeights, prepare_tc_weights

# moe.py imports the Triton kernels (routing.py) at its top; its names load on first use, so that the triton-free
# helpers here and in the submodules (layouts, torch twins) import on a machine without triton.
_FROM_MOE = ("MAX_TOKENS", "DecodeBuffers", "moe_decode", "moe_decode_torch")


def __getattr__(name: str):
    if name in _FROM_MOE:
        from . import moe

        return getattr(moe, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LaunchConfig", "DecodeWeights", "TileShape", "checkpoint_from_decode", "prepare_decode_weights",
           "TCWeights", "prepare_tc_weights", "MAX_TOKENS", "DecodeBuffers", "moe_decode", "moe_decode_torch"]
