"""What one CTA of a fused SM90 Mega MoE kernel is made of, from a launch plan: its warps and their
roles, its registers, and its shared memory (fixed regions and the TMA -> WGMMA pipeline stages).

    a = flashinfer_anatomy(plan_detail, geometry)      # plan: the `plan.detail` a results row records
    a = deepgemm_fp8_anatomy(plan, geometry)           # or deepgemm_sm90_fp8_config(...)
    a = deepgemm_fp4_anatomy(config, geometry)         # deepgemm_sm90_fp4_config(...)
    a.roles          (Role(name, first_warp, warps, registers, does), ...) in warp order
    a.threads, a.warps, a.smem_bytes, a.stage_bytes

Every count comes from the plan and the kernels' sources (FlashInfer 0.7.4
``include/flashinfer/megamoe/sm90_mxfp4_mega_moe_fused*.cuh``; DeepGEMM PR #323
``sm90_fp8_fp4_mega_moe.cuh`` and its FP8 sibling). ``megamoe.teaching.plans_viz`` draws them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..geometry import get_geometry
from ..layouts.deepgemm_configs import SM90_SMEM_CAPACITY


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


@dataclass(frozen=True)
class Role:
    name: str  # "dispatch", "TMA A", "TMA B", "decode", "math WG0", ...
    first_warp: int
    warps: int
    registers: int | None  # per thread after setmaxnreg (None: not read from the source)
    does: str


@dataclass(frozen=True)
class Region:
    name: str
    bytes: int
    per_stage: bool = False  # one copy per pipeline stage


@dataclass(frozen=True)
class KernelAnatomy:
    kernel: str  # the backend name (megamoe.palette colours)
    block_m: int
    block_n: int
    num_stages: int
    swap_ab: bool
    num_experts_per_wave: int
    roles: tuple[Role, ...]
    regions: tuple[Region, ...]
    combine_ring_bytes: int = 0  # the combine phase reuses the GEMM's shared memory as its own ring
    block_k: int = 128

    @property
    def warps(self) -> int:
        return sum(r.warps for r in self.roles)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def stage_bytes(self) -> int:
        return sum(r.bytes for r in self.regions if r.per_stage)

    @property
    def smem_bytes(self) -> int:
        """Fixed regions + num_stages x stage, or the combine ring where that is larger."""
        gemm = sum(r.bytes for r in self.regions if not r.per_stage) + self.num_stages * self.stage_bytes
        return max(gemm, self.combine_ring_bytes)

    def role(self, name: str) -> Role:
        return next(r for r in self.roles if r.name == name)


def _roles(spec: list[tuple[str, int, int | None, str]]) -> tuple[Role, ...]:
    out, warp = [], 0
    for name, n, regs, does in spec:
        if n:
            out.append(Role(name, warp, n, regs, does))
            warp += n
    return tuple(out)


def _math_roles(wgs: int, regs: int | None, does: str) -> list[tuple[str, int, int | None, str]]:
    return [(f"math WG{i}", 4, regs, does) for i in range(wgs)]


# FlashInfer 0.7.4 MXFP4 weight tiles: 128 rows x 128 K, 64 B of codes + 4 E8M0 bytes per row.
FI_B_TILE_ROWS, FI_B_TILE_BYTES = 128, 128 * 64 + 128 * 4


def flashinfer_anatomy(plan: dict, geometry) -> KernelAnatomy:
    """FlashInfer ``mxfp4_mega_moe`` from its plan fields (block_m, block_n, num_stages, swap_ab,
    rs_swap_ab, single_active_dispatch_warp, num_experts_per_wave, use_interleaved_scheduler)."""
    g = get_geometry(geometry)
    bm, bn, stages = int(plan["block_m"]), int(plan["block_n"]), int(plan["num_stages"])
    swap, rs = bool(plan["swap_ab"]), bool(plan.get("rs_swap_ab", False))
    split_decode = swap and not rs and bm >= 16  # decode gets its own 8 warps (sm90_mxfp4_split_decode)
    split_m = bm == 128 and bn == 128
    active = 1 if plan.get("single_active_dispatch_warp") else 2
    math_does = ("WGMMA (swap-AB: weights on M, tokens on N)" if swap else "WGMMA") + \
        ("" if split_decode else (", A from registers" if rs else ", FP4 decode")) + \
        "; epilogue: SwiGLU, FP8 requant, L2 rows written to the source rank; then the top-k combine"
    roles = _roles([
        ("dispatch", 2, 48, f"{active} active: count routes, pull token rows + scales from the source ranks"),
        ("TMA A", 1, 64 if plan.get("use_interleaved_scheduler") else 40,
         "activations + scales (TMA), after the pool block's rows arrived; claims tasks"),
        ("TMA B", 1, 64 if plan.get("use_interleaved_scheduler") else 40, "packed MXFP4 weight tiles (bulk copy)"),
        ("decode", 8 if split_decode else 0, 48, "FP4 -> e4m3 into the decoded-weight ring"),
        *_math_roles(2, 152 if split_decode else 208, math_does)])
    wg_bn = bn if split_m else bn // 2
    cd = max(2 * (bm // 2 if split_m else bm) * (wg_bn // 2), bm * bn * 2 if swap else 0)
    cd = _align(cd + max(2 * bm, bm * 8 if swap else 0) * 4, 1024)
    decoded = 2 if (split_m or split_decode) else (0 if rs else 1)
    regions = (
        Region("expert counts", _align(g.num_experts * 4, 1024)),
        Region("dispatch landing rows", _align(g.hidden * active, 1024)),
        Region("E8M0 -> e4m3 tables", _align(256 * 8, 1024)),
        Region("epilogue staging (CD)", cd),
        Region("decoded weights (e4m3)", decoded * bn * 128),
        Region("A: activations", bm * 128, True),
        Region("B: packed MXFP4 weights", bn // FI_B_TILE_ROWS * FI_B_TILE_BYTES, True),
        Region("A scales", (2 if split_m else 1) * _align(bm * 4, 128), True),
    )
    ring = 3 * 8 * g.hidden * 2 // (1 if g.hidden <= 4096 else 2)  # 3 bf16 row chunks per math warp
    return KernelAnatomy("flashinfer-mxfp4", bm, bn, stages, swap, int(plan["num_experts_per_wave"]), roles,
                         regions, combine_ring_bytes=ring)


def _deepgemm_common(cfg: dict, g) -> tuple[int, int, int, int, int, bool]:
    return (int(cfg["block_m"]), int(cfg["block_n"]), int(cfg["num_dispatch_threads"]) // 32,
            int(cfg["num_non_epilogue_threads"]) // 32, int(cfg["num_epilogue_threads"]) // 128, bool(cfg["swap_ab"]))


def deepgemm_fp8_anatomy(config: dict, geometry) -> KernelAnatomy:
    """DeepGEMM ``fp8_mega_moe`` (SM90) from its ``MegaMoESM90Config`` fields: a recorded plan
    (``{"block_m", **plan.detail}``) or ``deepgemm_sm90_fp8_config``."""
    g = get_geometry(geometry)
    bm, bn, d_warps, n_warps, wgs, swap = _deepgemm_common(config, g)
    roles = _roles([
        ("dispatch", d_warps, None, "count routes, pull token rows + scales from the source ranks"),
        ("TMA A", 1, None, "activations + scales (TMA)"),
        ("TMA B", 1, None, "FP8 weight tiles + scales (TMA)"),
        ("idle", n_warps - 2, None, "no role in this configuration"),
        *_math_roles(wgs, None, ("WGMMA (swap-AB)" if swap else "WGMMA") + "; epilogue: SwiGLU, FP8 requant, "
                     "L2 rows written to the source rank; then the top-k combine")])
    cd = max(bm * bn // 2, bm * bn * 2, bm * bn // 2 * 5 if swap else 0)
    regions = (
        Region("expert counts", _align(g.num_experts * 4, 1024)),
        Region("dispatch landing rows", _align(g.hidden * d_warps, 1024)),
        Region("epilogue staging (CD)", _align(cd, 1024)),
        Region("barriers", (d_warps + 2 * wgs * 4) * 8),
        Region("A: activations", bm * 128, True),
        Region("B: FP8 weights", bn * 128, True),
        Region("A scales", _align(2 * bm * 4, 128), True),
        Region("stage barriers", 16, True),
    )
    return KernelAnatomy("deepgemm-sm90-fp8", bm, bn, int(config["num_stages"]), swap,
                         int(config["num_experts_per_wave"]), roles, regions)


def deepgemm_fp4_anatomy(config: dict, geometry) -> KernelAnatomy:
    """DeepGEMM SM90 FP8 x FP4 (PR #323) from ``deepgemm_sm90_fp4_config``: the loader warps, the
    decode-assist warps (``first_decode_assist_warp`` 2: the loaders do not decode) and whether the
    math warpgroups decode too."""
    g = get_geometry(geometry)
    bm, bn, d_warps, n_warps, wgs, swap = _deepgemm_common(config, g)
    loaders_decode = int(config["first_decode_assist_warp"]) == 0
    math_decodes = bool(config["math_wg_participates_in_decode"])
    roles = _roles([
        ("dispatch", d_warps, 48, "count routes, pull token rows + scales from the source ranks"),
        ("TMA A", 1, 40, "activations + scales (TMA)" + (" ; decodes" if loaders_decode else "")),
        ("TMA B", 1, 40, "packed FP4 weights (TMA) + UE8M0 scales (cp.async)" + (" ; decodes" if loaders_decode else "")),
        ("decode", n_warps - 2, 40, "FP4 -> e4m3 with the per-32 scale folded in (table), into shared memory"),
        *_math_roles(wgs, 160 if bm == 64 and wgs > 1 else 208,
                     ("WGMMA (swap-AB)" if swap else "WGMMA") + (" + FP4 decode" if math_decodes else "")
                     + "; epilogue: SwiGLU, FP8 requant, L2 rows written to the source rank; then the combine")])
    flags = 8 * bool(config.get("early_b_decode")) + 8 * bool(config.get("decode_done_mbarrier"))
    cd = max(bm * bn // 2, bm * bn * 2, bm * bn // 2 * (1 if config.get("swap_ab_fast_amax") else 5) if swap else 0)
    shares_sf = bm == 64 and wgs > 1 and bn // wgs >= 64 and bn // wgs // 2 < 64
    regions = (
        Region("expert counts", _align(g.num_experts * 4, 1024)),
        Region("dispatch landing rows", _align(g.hidden * d_warps, 1024)),
        Region("epilogue staging (CD)", _align(cd, 1024) + (1024 if shares_sf else 0)),
        Region("barriers", (d_warps + 2 * wgs * 4) * 8),
        Region("A: activations", bm * 128, True),
        Region("B: decoded e4m3 weights", bn * 128, True),
        Region("B: packed FP4 weights", bn * 64, True),
        Region("A scales", _align(2 * bm * 4, 128), True),
        Region("B scales (UE8M0)", _align(bn * 4, 128), True),
        Region("stage barriers", 16 + flags, True),
    )
    return KernelAnatomy("deepgemm-sm90-fp4", bm, bn, int(config["num_stages"]), swap,
                         int(config["num_experts_per_wave"]), roles, regions)


def fits(a: KernelAnatomy) -> bool:
    return a.smem_bytes <= SM90_SMEM_CAPACITY


def recorded_plans(results: dict) -> dict:
    """{(backend, tokens): {"block_m", "detail"}} from a ``megamoe bench`` results.json (first pass rows).
    Results written before the harness rewrite nest the package's plan fields under ``detail``; later ones
    keep them flat beside ``block_m`` (``detail`` here then holds all of them, block_m included)."""
    out = {}
    for r in results["rows"]:
        if r.get("pass", 0) != 0 or "plan" not in r or r["backend"].startswith("reference"):
            continue
        p = r["plan"]
        out[r["backend"], r["tokens"]] = p if "detail" in p else {
            "block_m": p.get("block_m"), "detail": {k: v for k, v in p.items() if k != "forced"}}
    return out
