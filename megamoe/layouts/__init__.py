"""Weight and activation layouts of each kernel, with exact inverses, range checks and plan models.

    checkpoint       DeepSeek-V4 safetensors experts <-> MXFP4Weights (lazy, per-rank loader)
    flashinfer_sm90  FlashInfer SM90 MXFP4 chunk-major tiles (Marlin order, interleave, sign braid)
    deepgemm_sm90    DeepGEMM SM90 FP8 (e4m3 + FP32 128x128) and FP4 (UE8M0 x4) layouts
    deepgemm_sm100   DeepGEMM SM100 FP4 layout (read from source, never run)
    ranges           scale-range report, exact power-of-two rebase, or a clear refusal
    plans            BLOCK_M / plan rules, pool sizes, the data-parallel token-count rule
    staging          FP8 activation staging (bf16 -> e4m3 + per-token scales)
"""

from .checkpoint import expert_range_for_rank, load_layer, write_checkpoint
from .deepgemm_sm90 import (
    from_deepgemm_sm90_fp4,
    from_deepgemm_sm90_fp8,
    to_deepgemm_sm90_fp4,
    to_deepgemm_sm90_fp8,
    to_fp8_block,
)
from .deepgemm_sm100 import from_deepgemm_sm100_fp4, to_deepgemm_sm100_fp4
from .flashinfer_sm90 import (
    from_flashinfer_sm90,
    from_marlin_order,
    prepare_flashinfer_sm90,
    to_flashinfer_sm90,
    to_marlin_order,
)
from .plans import (
    agreed_token_count,
    deepgemm_plan_hint,
    deepgemm_sm90_fp8_plan,
    flashinfer_legal_block_ms,
    flashinfer_mxfp4_plan,
    flashinfer_pool_tokens,
    padding_waste,
)
from .ranges import RangeReport, analyze_ranges, check_ranges, fold_global_scales, repair_ranges
