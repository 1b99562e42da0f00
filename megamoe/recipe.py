"""Numerics recipes: where each kernel rounds, at what granularity, in which order.

A ``Recipe`` names every choice that differs between the fused kernels, so that the eager reference
reproduces a kernel's quantization points exactly and the only residual left is how the tensor cores
accumulate inside one 128-wide K block. The contract is ``docs/kernel-contract.md``.

Pipeline stages and the recipe fields that steer them:
    stage x         stage_x, x_gran, x_scale, fp8_scale_rule  (bf16 -> e4m3 + scale per token per gran)
    decode weights  weight_format, weight_decode          (MXFP4 -> the e4m3 value the MMA reads)
    L1 GEMM         promote_k, accum, mma, accumulate     (per-K-block promotion of x_sf, FP32 acc)
    global scales   global_scales                         (gs1 on L1 acc before the clamp, gs2 on L2)
    SwiGLU          gate_up_bf16, silu_exp, swiglu_bf16   (round gate/up to bf16 first; the exp; bf16 output)
    routing weight  routing_weight                        (folded in before the requant, or at the combine)
    L2 requant      l2_group, l2_scale, l2_amax_floor
    L2 GEMM         slot_output_bf16                      (bf16 per (token, slot))
    combine         combine_bf16                          (FP32 slot-ordered sum, one bf16 rounding)
    weight window   max_scale_span                        (Humming W4A8: bytes within [max - span, max] per tensor)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .formats import WEIGHT_DECODERS, scale_byte_window

WEIGHT_DECODES = tuple(WEIGHT_DECODERS)  # ("exact", "e4m3_flush_saturate", "e4m3_rn")
L2_SCALES = ("pow2_ceil", "continuous", "div448")
FP8_SCALE_RULES = ("mul-inv448", "div448")
ROUTING_WEIGHTS = ("before-requant", "at-combine")
MMA_MODELS = ("exact-block", "sm90-fp8-tc", "sm90-fp8-tc-operands")  # megamoe.reference.tensorcore.MODELS
ACCUMULATE_MODES = ("promote", "rescale", "rescale-ratio")
SILU_EXPS = ("fp32", "fp64-rounded", "fast-math")


@dataclass(frozen=True)
class Recipe:
    """One kernel's numerics. ``accum`` is the dtype the reference accumulates GEMMs in.

    weight_decode:
        ``exact``               the MXFP4 value itself (dequantized, any scale)
        ``e4m3_flush_saturate`` FlashInfer's decoder: e2m1 * 2**s as e4m3, |v| < 2**-6 -> 0, > 448 -> 448
        ``e4m3_rn``             DeepGEMM SM90 FP4 table: e4m3 round-to-nearest with subnormals
    l2_scale:
        ``pow2_ceil``   sf = 2**ceil(log2(amax * fl32(1/448))), amax 0 -> sf 0
        ``continuous``  sf = max(amax, l2_amax_floor) * fl32(1/448)
        ``div448``      sf = max(fl32(amax / 448), fl32(1e-30)): an IEEE division (Humming's process_input)
    fp8_scale_rule (staging x):
        ``mul-inv448``  DeepGEMM's per_token_cast_to_fp8 as it runs on CUDA: max(amax, 1e-4) * fl32(1/448)
        ``div448``      Humming's process_input: max(fl32(amax / 448), fl32(1e-30))
    routing_weight:
        ``before-requant``  v * w before the L2 requant (the Mega MoE kernels); the combine sums the slots
        ``at-combine``      the L2 input is v alone; the combine is acc = fma(slot, w, acc) in FP32 (vLLM's
                            Humming chain: ``moe_fused_mul_sum``)
    silu_exp:
        ``fp32``          exp(-g) in FP32 (each device's own exp: not bit-reproducible across devices)
        ``fp64-rounded``  exp(-g) in float64, rounded once to FP32 (devices agree unless their float64
                          exp straddles an FP32 rounding boundary: ~2**-28 per element)
        ``fast-math``     CUDA's __expf(-g) = ex2.approx(fl32(-g * fl32(log2 e))): the rounded argument
                          modelled exactly, ex2 as float64 exp2 rounded once (kernels built with fast_math)
    """

    name: str
    kernel: str
    weight_format: str = "mxfp4"  # "mxfp4" or "fp8_block" (e4m3 + FP32 per 128x128)
    weight_decode: str = "exact"
    stage_x: bool = True
    x_gran: int = 128
    x_scale: str = "fp32"  # "fp32" (SM90) or "ue8m0" (SM100: power of two per x_gran)
    fp8_scale_rule: str = "mul-inv448"  # how an FP32 x scale is computed (docstring)
    promote_k: int = 128
    global_scales: bool = False
    gate_up_bf16: bool = False
    silu_exp: str = "fp32"
    swiglu_bf16: bool = False  # SwiGLU's output rounded to bf16 before the requant / the L2 GEMM
    routing_weight: str = "before-requant"
    l2_group: int | None = 128  # None: no requant, L2 reads FP32 activations
    l2_scale: str = "pow2_ceil"
    l2_amax_floor: float = 0.0
    slot_output_bf16: bool = True
    combine_bf16: bool = True
    accum: torch.dtype = torch.float32
    # How the tensor cores sum one promotion block (megamoe.reference.tensorcore): "exact-block" rounds
    # the exact block sum once to FP32; "sm90-fp8-tc-operands" emulates the H200's FP8 accumulation bit by
    # bit (on the test vectors of lab/numerics/tc_fit.py); "sm90-fp8-tc" is the earlier, 90%-exact fit.
    mma: str = "exact-block"
    # How the block sums are combined (megamoe.reference.gemm): "promote" (fresh block, FFMA into an FP32
    # accumulator), "rescale" / "rescale-ratio" (one running tensor-core accumulator, divided by each
    # block's scale before its MMAs: DeepGEMM SM90 FP8's kReuseAccumAsFinal configurations).
    accumulate: str = "promote"
    # Legal E8M0 scale bytes for groups with nonzero codes: derived from ``weight_decode`` (the bytes under
    # which all 16 e2m1 codes decode exactly, ``formats.scale_byte_window``), not set by hand; None for
    # FP8 block weights. Checked, never clipped.
    min_scale_byte: int | None = field(default=None, init=False)
    max_scale_byte: int | None = field(default=None, init=False)
    # Humming W4A8: per (expert, tensor) the bytes of nonzero groups must lie in [max - span, max]
    # (megamoe.layouts.humming); None: no relative window (the absolute one above applies).
    max_scale_span: int | None = None
    verified: str = "read from source"  # what on-hardware evidence backs this recipe

    def __post_init__(self) -> None:
        if self.weight_decode not in WEIGHT_DECODES:
            raise ValueError(f"weight_decode must be one of {WEIGHT_DECODES}, got {self.weight_decode!r}")
        if self.l2_scale not in L2_SCALES:
            raise ValueError(f"l2_scale must be one of {L2_SCALES}, got {self.l2_scale!r}")
        if self.weight_format not in ("mxfp4", "fp8_block"):
            raise ValueError(f"weight_format must be 'mxfp4' or 'fp8_block', got {self.weight_format!r}")
        if self.accumulate not in ACCUMULATE_MODES:
            raise ValueError(f"accumulate must be one of {ACCUMULATE_MODES}, got {self.accumulate!r}")
        if self.mma not in MMA_MODELS:
            raise ValueError(f"mma must be one of {MMA_MODELS}, got {self.mma!r}")
        if self.silu_exp not in SILU_EXPS:
            raise ValueError(f"silu_exp must be one of {SILU_EXPS}, got {self.silu_exp!r}")
        if self.fp8_scale_rule not in FP8_SCALE_RULES:
            raise ValueError(f"fp8_scale_rule must be one of {FP8_SCALE_RULES}, got {self.fp8_scale_rule!r}")
        if self.routing_weight not in ROUTING_WEIGHTS:
            raise ValueError(f"routing_weight must be one of {ROUTING_WEIGHTS}, got {self.routing_weight!r}")
        if self.x_scale not in ("fp32", "ue8m0"):
            raise ValueError(f"x_scale must be 'fp32' or 'ue8m0', got {self.x_scale!r}")
        if self.l2_group is not None and (self.l2_group <= 0 or 128 % self.l2_group and self.l2_group % 128):
            raise ValueError(f"l2_group must divide or be a multiple of 128, got {self.l2_group}")
        window = scale_byte_window(self.weight_decode) if self.weight_format == "mxfp4" else (None, None)
        object.__setattr__(self, "min_scale_byte", window[0])  # frozen: set once, here
        object.__setattr__(self, "max_scale_byte", window[1])

    def with_(self, **changes) -> "Recipe":
        return replace(self, **changes)


EXACT = Recipe(
    name="exact",
    kernel="none: dequantized weights, unquantized activations, float64 throughout",
    stage_x=False,
    l2_group=None,
    slot_output_bf16=False,
    combine_bf16=False,
    accum=torch.float64,
)

FLASHINFER_MXFP4 = Recipe(
    name="flashinfer-mxfp4",
    kernel="flashinfer.megamoe.mxfp4_mega_moe (FlashInfer 0.7.4, SM90)",
    weight_decode="e4m3_flush_saturate",
    global_scales=True,
    l2_group=128,
    l2_scale="pow2_ceil",
)  # scale bytes 122..133 (2**-5 .. 2**6)

DEEPGEMM_SM90_FP4 = Recipe(
    name="deepgemm-sm90-fp4",
    kernel="deep_gemm fp8_fp4_mega_moe on SM90 (DeepGEMM PR #323; not in any installable package)",
    weight_decode="e4m3_rn",
    l2_group=64,
    l2_scale="pow2_ceil",
    # The backend launches with fast_math=True (__expf, rcp.approx). Modelling __expf (silu_exp="fast-math")
    # was measured on the H200 matrix and matched no more L2-input codes (24 cases: 23 calc_diff identical,
    # small-T300 1.24e-7 -> 1.33e-7), so the plain FP32 exp stays.
)  # scale bytes 119..133 (2**-8 .. 2**6), derived from e4m3_rn: below, 0.5 x 2**-9 falls under e4m3's
# smallest subnormal; above, 6 x 2**7 passes 448 (the kernel's table wraps there; measured on the H200)

DEEPGEMM_SM90_FP8 = Recipe(
    name="deepgemm-sm90-fp8",
    kernel="deep_gemm.fp8_mega_moe (sgl-deep-gemm 0.1.5.post1, SM90, recipe (128, 128, 128))",
    weight_format="fp8_block",
    l2_group=64,
    # The 0.1.5.post1 source: "Continuous FP32 activation scale", amax floored at 1e-10.
    l2_scale="continuous",
    l2_amax_floor=1e-10,
)

DEEPGEMM_SM100_FP4 = Recipe(
    name="deepgemm-sm100-fp4",
    kernel="deep_gemm fp8_fp4_mega_moe on SM100 (Blackwell; no such card here, never run)",
    x_gran=32,
    x_scale="ue8m0",
    promote_k=32,
    gate_up_bf16=True,
    l2_group=32,
    l2_scale="pow2_ceil",
)

MEGAMOE_DECODE = Recipe(
    name="megamoe-decode",
    kernel="megamoe.decode (Triton, FP64-exact block sums on CUDA cores; 1..64 tokens per rank)",
    # Where it rounds, in order (megamoe/decode/triton_gemv.py; docs/decode-kernel.md):
    #  1. x staged as DeepGEMM's per_token_cast_to_fp8 (e4m3 + FP32 scale per 128), like every kernel here.
    #  2. Weights decoded exactly: e2m1 * 2**(s - 127), any E8M0 byte but 0xFF; no global scales (folded).
    #  3. L1 per 128-K block: the exact sum of x_q * w (float64, exact when the block's scale bytes
    #     span <= 24 binades: checked at prepare), rounded once to FP32; promoted in ascending K as
    #     acc = fl32(fl64(acc + x_sf * block)) (the reference's emulated FMA, bit for bit).
    #  4. SwiGLU in FP32: g = min(g, clamp), u = clamp(u, -clamp, clamp), e = fl32(exp64(-g)),
    #     v = (g * (1 / (1 + e))) * u with IEEE division, then v * topk_weight (before the requant).
    #  5. Requant per token per 32 channels: sf = max(amax, fl32(1e-10)) * fl32(1/448), q = e4m3 RTNE of
    #     v * (1 / sf), clamped to +-448.
    #  6. L2 the same as 3 with 32-K blocks (one L2 scale per block), then bf16 RTNE per (token, slot).
    #  7. Combine: FP32 sum over the slots in ascending slot order, masked skipped, one bf16 rounding.
    weight_decode="exact",
    l2_group=32,
    l2_scale="continuous",
    l2_amax_floor=1e-10,
    silu_exp="fp64-rounded",
    # scale bytes 0..252 (derived from the exact decode: 6 * 2**(253 - 127) overflows FP32)
    verified=("CPU: Triton interpreter bit-identical to this recipe (tests/test_decode.py); H200: bit-identical at "
              "1..64 tokens (bench/results/2026-12-03_nvidia-h200_52af10a27c; with the prefetch at 1, 8, 32: "
              "..._tc-operands/decode-prefetch)"),
)

MEGAMOE_DECODE_TC = MEGAMOE_DECODE.with_(
    name="megamoe-decode-tc",
    kernel="megamoe.decode tensor-core path (Triton FP8 MMAs, one per 32-K scale group; 1..64 tokens per rank)",
    # Where it differs from megamoe-decode (megamoe/decode/triton_tc.py; reference.gemm.group_scaled_gemm):
    #  2. Weights enter the MMA as e2m1 * 2**-6 (e4m3, exact); 2**(s - 121) multiplies each 32-K group's sum
    #     in FP32, exact for scale bytes 20..236 (the e4m3_group decode's window; others refused at prepare).
    #  3. Each group's sum is the tensor cores' own (a fresh k32 MMA, sm90-fp8-tc-operands); a 128-K block is
    #     the FP32 sum of its 4 scaled groups in ascending K; promoted as acc = fl32(acc + fl32(x_sf * block))
    #     (two FP32 roundings: no float64 on the tensor-core path).
    #  6. L2 the same, one group per promotion block.
    weight_decode="e4m3_group",
    mma="sm90-fp8-tc-operands",
    verified=("CPU: Triton interpreter bit-identical on inputs whose group sums are exact (tests/test_decode_tc.py); "
              "H200: bit-identical at 1..64 tokens and on the megamoe check matrix's 19 cases "
              "(bench/results/2026-12-04_nvidia-h200_decode-tc)"),
)

HUMMING_W4A8 = Recipe(
    name="humming-w4a8",
    kernel=("humming.humming_forward, indexed MoE GEMMs with FP8 e4m3 activations per 128 (humming-kernels 0.1.20, "
            "SM90), chained as vLLM's HummingIndexedExperts runs them"),
    # Where it rounds, in order (megamoe/fused/humming.py; humming's sources):
    #  1. x staged by Humming's process_input: sf = max(fl32(amax / 448), fl32(1e-30)) per token per 128 (an IEEE
    #     division, not DeepGEMM's multiply by fl32(1/448)), q = e4m3 RTNE satfinite of x * fl32(1 / sf).
    #  2. Weights: e2m1 x 2**byte' (an exact e4m3) with the per-expert weight_scale_2 on the output: exact for the
    #     bytes in [max - 11, max] of each (expert, sublayer) (megamoe.layouts.humming; others are refused, or
    #     rewritten as the kernel rewrites them under accept_lossy_scales).
    #  3. Gate/up: FP8 tensor-core block sums per 128-K block promoted with the activation scale in FP32, then
    #     bf16 (the GEMM's output dtype).
    #  4. SwiGLU from the bf16 gate/up in FP32 (float64 exp rounded once, IEEE division), rounded to bf16.
    #  5. Requant per token per 128 by step 1's rule; the routing weight is NOT folded in.
    #  6. Down: as 3, bf16 per (token, slot).
    #  7. Combine: acc = fma(slot, w, acc) in FP32 over the slots in ascending order, masked skipped, then bf16.
    weight_decode="exact",
    fp8_scale_rule="div448",
    gate_up_bf16=True,
    silu_exp="fp64-rounded",
    swiglu_bf16=True,
    routing_weight="at-combine",
    l2_group=128,
    l2_scale="div448",
    mma="sm90-fp8-tc-operands",
    max_scale_span=11,
    verified="read from source (humming-kernels 0.1.20); the H200 matrix is the test",
)

HUMMING_W4A16 = Recipe(
    name="humming-w4a16",
    kernel=("humming.humming_forward, indexed MoE GEMMs with bf16 activations (humming-kernels 0.1.20, SM90, "
            "mma.sync), chained as vLLM's HummingIndexedExperts runs them"),
    # bf16 x and bf16 weights (e2m1 x 2**(byte - 127), exact) multiply exactly; the kernel sums them in FP32 in its
    # own order, the reference in float64 and rounds once to bf16 (the GEMM's output): the residual is that order.
    stage_x=False,
    weight_decode="exact",
    gate_up_bf16=True,
    silu_exp="fp64-rounded",
    swiglu_bf16=True,
    routing_weight="at-combine",
    l2_group=None,
    accum=torch.float64,
    verified="read from source (humming-kernels 0.1.20); the H200 matrix is the test",
)

RECIPES: dict[str, Recipe] = {
    r.name: r for r in (EXACT, FLASHINFER_MXFP4, DEEPGEMM_SM90_FP4, DEEPGEMM_SM90_FP8, DEEPGEMM_SM100_FP4,
                        MEGAMOE_DECODE, MEGAMOE_DECODE_TC, HUMMING_W4A8, HUMMING_W4A16)
}


def get_recipe(name_or_recipe: "str | Recipe") -> Recipe:
    if isinstance(name_or_recipe, Recipe):
        return name_or_recipe
    try:
        return RECIPES[name_or_recipe]
    except KeyError:
        raise ValueError(f"unknown recipe {name_or_recipe!r}; expected one of {sorted(RECIPES)}") from None
