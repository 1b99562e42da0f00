"""FlashInfer 0.7.4 ``mxfp4_mega_moe``: FP8 activations x MXFP4 experts, one persistent SM90 kernel.

Weights: ``megamoe.layouts.flashinfer_sm90.prepare_flashinfer_sm90`` (exact power-of-two rebase of the
scales into the decoder's window 2**-5..2**6, the excess in per-expert global scales gs1 / gs2, then
Marlin order, gate/up interleave, sign braid, chunk-major 8704-byte tiles).

Plans: FlashInfer picks a ``FusedPlan`` from the token count (``select_mxfp4_fused_plan``); each distinct
plan is a JIT build. On the H200 (132 SMs) the reachable BLOCK_Ms are 8 and 24 (swap-AB) and 64 (no
swap); the kernel also compiles 16 / 32 (swap-AB) and 128 (split-M) but the selector never picks them
on this card. A ``block_m`` asked of ``plan`` / ``build`` / ``launch`` replaces the selected plan's tile
fields with those the selector uses for that BLOCK_M (swap-AB, register-source operand, pipeline depth),
keeping the token-dependent experts-per-wave.

Intermediates (``intermediates()``): the kernel's symmetric buffer holds the dispatched pool
``l1_token_buffer`` (e4m3 [P, H]), the L2 input ``l2_token_buffer`` (e4m3 [P, I]) and its scales
``l2_sf_buffer`` (fp32, K-major [I/64, P_sf]); offsets from FlashInfer's own layout query.
"""

from __future__ import annotations

import dataclasses

import torch

from ..inputs import MoEInputs
from ..recipe import FLASHINFER_MXFP4
from .base import FusedBackend, Plan, kernel_availability

LEGAL_BLOCK_MS_H200 = (8, 24, 64)


def _import():
    import flashinfer.megamoe as fm  # noqa: F401
    from flashinfer.megamoe import heuristics  # noqa: F401

    return fm


class FlashInferMXFP4(FusedBackend):
    name = "flashinfer-mxfp4"
    recipe = FLASHINFER_MXFP4
    weight_format = "mxfp4"
    kernel = "flashinfer.megamoe.mxfp4_mega_moe (FlashInfer 0.7.4)"
    kernel_module = "flashinfer"
    parallel_builds = True  # each plan is an independent JIT compile (~15 s on the H200)

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        return kernel_availability(
            _import, "flashinfer.megamoe", ("mxfp4_mega_moe", "MegaMoESymmBuffer", "select_mxfp4_fused_plan", "_run_kernel"))

    @classmethod
    def synthetic_weights(cls, weights):
        """The exact rebase ``prepare`` applies anyway (values unchanged), so that a reference run on the
        returned weights decodes what the kernel decodes."""
        from ..layouts.ranges import repair_ranges

        return repair_ranges(weights, cls.recipe)

    def legal_block_ms(self, num_tokens: int | None = None) -> tuple[int, ...]:
        return LEGAL_BLOCK_MS_H200

    # ------------------------------------------------------------------ weights and buffer
    def _prepare(self, weights) -> None:
        from ..layouts.flashinfer_sm90 import prepare_flashinfer_sm90
        from ..layouts.ranges import repair_ranges

        self.kernel_weights = repair_ranges(weights, self.recipe)  # canonical form of what the kernel reads
        p = prepare_flashinfer_sm90(self.kernel_weights)  # repaired already: its repair and check find one analysis
        self.l1, self.l2 = p.l1.contiguous(), p.l2.contiguous()
        self.gs1, self.gs2 = p.l1_global_scales.contiguous(), p.l2_global_scales.contiguous()

    def _allocate(self) -> None:
        fm = _import()
        g = self.g
        self.buf = fm.MegaMoESymmBuffer(
            self.group, g.num_experts, self.capacity, g.num_topk, g.hidden, g.intermediate,
            activation_clamp=float(g.clamp), fast_math=True,
        )
        self.y = torch.empty(self.capacity, g.hidden, dtype=torch.bfloat16, device=self.device)
        off = self.buf._offsets
        self._off = {"l1": off[5], "l1_sf": off[6], "l2": off[7], "l2_sf": off[8]}
        self.num_pool = int(off[9])
        self.num_sf_pool = int(off[10])

    # ------------------------------------------------------------------ plans
    def _select(self, m: int):
        fm = _import()
        b, g = self.buf, self.g
        return fm.select_mxfp4_fused_plan(b.num_sms, self.num_ranks, g.num_experts, g.num_topk, g.hidden,
                                          g.intermediate, self.capacity, m)

    def kernel_plan(self, m: int, block_m: int | None = None):
        """The FusedPlan a launch of m tokens uses: the selector's, or its variant at ``block_m``."""
        p = self._select(m)
        bm = block_m
        if bm is None or bm == p.block_m:
            return p
        if bm == 64:
            return dataclasses.replace(p, block_m=64, swap_ab=False, rs_swap_ab=False, num_stages=3,
                                       single_active_dispatch_warp=False)
        if bm == 24:
            return dataclasses.replace(p, block_m=24, swap_ab=True, rs_swap_ab=False, num_stages=3,
                                       single_active_dispatch_warp=True)
        if bm == 8:
            rs = not (self.buf.num_sms > 78 and m <= 16)  # the selector's rule for BM8 on a big card
            return dataclasses.replace(p, block_m=8, swap_ab=True, rs_swap_ab=rs, num_stages=8 if rs else 4,
                                       single_active_dispatch_warp=True)
        raise ValueError(f"{self.name}: cannot force BLOCK_M {bm}")

    def plan(self, num_tokens: int, block_m: int | None = None) -> Plan:
        self._need_allocated("plan")
        p = self.kernel_plan(int(num_tokens), block_m)
        return Plan(p.block_m, forced=block_m is not None, detail=dataclasses.asdict(p))

    def _module(self, p):
        fm = _import()
        factory = fm.gen_megamoe_sm90_mxfp4_module
        return fm._get_jit_module(factory, *fm._jit_args(factory, p, self.buf))

    def _build_job(self, num_tokens: int, block_m: int | None = None):
        p = self.kernel_plan(num_tokens, block_m)
        return p, (lambda: self._module(p))

    # ------------------------------------------------------------------ run
    def _stage(self, inputs: MoEInputs, m: int) -> None:
        super()._stage(inputs, m)  # stage_into the buffer's views
        self.buf.commit_staged(m)

    def launch(self, num_tokens: int, block_m: int | None = None) -> torch.Tensor:
        fm = _import()
        m = int(num_tokens)
        p = self.kernel_plan(m, block_m)
        self._launched_block_m = p.block_m  # what intermediates() reports: the plan this launch ran
        fm._run_kernel(fm.gen_megamoe_sm90_mxfp4_module, "megamoe_sm90_mxfp4_fused", p, self.y, self.l1, self.l2,
                       self.buf, m, None, self.gs1, self.gs2)
        return self.y[:m]

    # ------------------------------------------------------------------ intermediates
    def _region(self, start: int, nbytes: int) -> torch.Tensor:
        return self.buf.buffer[start : start + nbytes].view(torch.uint8)

    def poison_intermediates(self) -> None:
        g = self.g
        end = self._off["l2_sf"] + self.num_sf_pool * (g.intermediate // 16)
        self._region(self._off["l1"], end - self._off["l1"]).fill_(0x7F)
        self.y.fill_(float("nan"))

    def intermediates(self) -> dict:
        g = self.g
        p, psf = self.num_pool, self.num_sf_pool
        pool_x = self._region(self._off["l1"], p * g.hidden).view(torch.float8_e4m3fn).view(p, g.hidden)
        l2 = self._region(self._off["l2"], p * g.intermediate).view(torch.float8_e4m3fn).view(p, g.intermediate)
        nk = g.intermediate // 64
        sf = self._region(self._off["l2_sf"], psf * nk * 4).view(torch.float32).view(nk, psf)
        return {"pool_x": pool_x.clone(), "l2_in": l2.clone(), "l2_in_sf_kmajor": sf.clone(), "l2_group": 128,
                "block_m": getattr(self, "_launched_block_m", None)}

    def destroy(self) -> None:
        buf = getattr(self, "buf", None)
        if buf is not None:
            buf.destroy()
