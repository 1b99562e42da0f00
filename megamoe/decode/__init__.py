"""megamoe's own small-batch FP8 x MXFP4 MoE path (1..64 tokens per rank): exact FP64 block sums on CUDA
cores, weights streamed once per step in a layout prepared once. Each Triton stage sits beside its torch
twin (same name + ``_torch``, same signature). Design and napkin math: docs/decode-kernel.md."""

from .gemv import LaunchConfig
from .layout import DecodeWeights, TileShape, checkpoint_from_decode, prepare_decode_weights
from .moe import MAX_TOKENS, DecodeBuffers, moe_decode, moe_decode_torch

__all__ = ["LaunchConfig", "DecodeWeights", "TileShape", "checkpoint_from_decode", "prepare_decode_weights",
           "MAX_TOKENS", "DecodeBuffers", "moe_decode", "moe_decode_torch"]
