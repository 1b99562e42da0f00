"""megamoe's own decode kernel (``megamoe.decode``) as a backend: 1..64 tokens per rank, EP = 1.

Weights: ``prepare_decode_weights`` (checkpoint bytes re-tiled so that each program streams its rows once,
exactness checked; global scales folded). Buffers: ``DecodeBuffers`` (plain device tensors, no symmetric
memory at EP = 1). ``launch`` is four Triton launches with no host sync and no allocation, so it may be
captured in a CUDA graph after ``build``. Numerics: ``MEGAMOE_DECODE``, the same bits as the reference.
"""

from __future__ import annotations

import torch

from ..decode.bounds import MAX_TOKENS
from ..recipe import MEGAMOE_DECODE, MEGAMOE_DECODE_TC
from ..inputs import MoEInputs
from ..validate import NonFiniteOutputError
from .base import FusedBackend, Plan


def default_block_m(num_tokens: int) -> int:
    """Tokens per program pass: an expert has ~1 row up to 16 tokens (6 T slots over 256 experts), ~2 at 64."""
    return 1 if num_tokens <= 16 else 2


def default_launch_config(num_tokens: int, block_m: int | None = None):
    """The launch ``megamoe-decode`` runs. Prefetching the next K-iteration's tile was measured on one H200
    (DeepSeek-V4-Flash, bench/results/2026-12-03_nvidia-h200_tc-operands/decode-prefetch): L1 faster at 1, 8
    and 32 tokens (66.4 -> 53.3, 362 -> 308, 1885 -> 1840 us), L2 faster at 1 (28.2 -> 25.2), even at 8
    (163 -> 166) and slower at 32 (903 -> 1037): on for L1, for L2 up to 8 tokens."""
    from ..decode import LaunchConfig

    return LaunchConfig(block_m=block_m or default_block_m(num_tokens), l1_prefetch=True,
                        l2_prefetch=num_tokens <= 8)


class MegaMoEDecode(FusedBackend):
    name = "megamoe-decode"
    recipe = MEGAMOE_DECODE
    weight_format = "mxfp4"
    persistent = False
    fused = True
    kernel = MEGAMOE_DECODE.kernel
    kernel_module = "triton"
    allows_zero_tokens = True
    split_tokens = 0  # tokens of the tensor-core L1's split-K scratch (MegaMoEDecodeTC)
    graph_capturable = True
    # The exact CUDA-core kernel (the teaching kernel: the exact recipe's bits, every weight decoded on CUDA cores) is
    # slower than FlashInfer and than megamoe-decode-tc at every count measured (README's sweep; docs/decode-kernel.md)
    in_all = False
    max_tokens_per_rank = MAX_TOKENS  # the decode path's one bound (megamoe.decode.bounds); the bench harness reads it

    def __init__(self, geometry, *, capacity: int, force_block_m: int | None = None, group=None) -> None:
        super().__init__(geometry, capacity=capacity, force_block_m=force_block_m, group=group)
        if self.capacity > self.max_tokens_per_rank:
            raise ValueError(f"{self.name}: supports at most {self.max_tokens_per_rank} tokens per rank (a decode "
                             f"kernel), got capacity {self.capacity}; use a fused backend for larger steps")

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        """(ok, every reason it cannot run here, joined by '; '): the device and the package are both asked, so
        a machine with no GPU and no triton hears of both."""
        return (not (why := cls.unavailable_reasons())), "; ".join(why)

    @classmethod
    def unavailable_reasons(cls) -> list[str]:
        why = []
        if not torch.cuda.is_available():
            why.append("no GPU: torch.cuda.is_available() is False")
        else:
            why += cls._device_reasons(*torch.cuda.get_device_capability())
        try:
            import triton  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            why.append(f"package missing: triton not importable ({type(exc).__name__}: {exc})")
        return why

    @classmethod
    def _device_reasons(cls, major: int, minor: int) -> list[str]:
        return [f"needs compute capability >= 8.0, got {major}.{minor}"] if major < 8 else []

    def legal_block_ms(self, num_tokens: int | None = None) -> tuple[int, ...]:
        return (1, 2, 4)  # tokens per program pass (the kernel has no BLOCK_M tile of its own)

    def launch_config(self, num_tokens: int, block_m: int | None = None):
        """The LaunchConfig of a launch of num_tokens at ``block_m`` (None: ``default_block_m``)."""
        return default_launch_config(num_tokens, self.resolve_block_m(block_m))

    def plan(self, num_tokens: int, block_m: int | None = None) -> Plan:
        cfg = self.launch_config(int(num_tokens), block_m)
        return Plan(cfg.block_m, forced=block_m is not None,
                    detail={"source": "tokens per program pass", "l1_warps": cfg.l1_warps, "l2_warps": cfg.l2_warps,
                            "l1_prefetch": cfg.l1_prefetch, "l2_prefetch": cfg.l2_prefetch})

    # ------------------------------------------------------------------ weights and buffers
    def _prepare(self, weights) -> None:
        from ..decode import prepare_decode_weights
        from ..decode.layout import fold_global_scales

        self.kernel_weights = fold_global_scales(weights)  # the values the kernel computes with
        self.dw = prepare_decode_weights(weights)

    def _allocate(self) -> None:
        from ..decode import DecodeBuffers

        if self.num_ranks != 1:
            raise ValueError(f"{self.name}: runs at EP = 1 only, got {self.num_ranks} ranks "
                             "(docs/decode-kernel.md says what EP > 1 needs)")
        self.buf = DecodeBuffers.allocate(self.g, self.capacity, self.device, split_tokens=self.split_tokens)

    def _build_job(self, num_tokens: int, block_m: int | None = None):
        """Triton compiles per specialization (constexprs, and whether int arguments such as T and W are 1 or
        multiples of 16): launch once on padding for every token count, so that a capture compiles nothing."""
        cfg = self.launch_config(num_tokens, block_m)

        def warm() -> None:
            self._stage(self._padding_inputs(), num_tokens)
            self.launch(num_tokens, block_m)
            torch.cuda.synchronize()

        return ("decode", num_tokens, cfg), warm

    def build(self, token_counts, max_workers: int = 8, block_m: int | None = None) -> int:
        return super().build(token_counts, max_workers=1, block_m=block_m)  # launches share the buffers: one at a time

    # ------------------------------------------------------------------ run
    def _stage(self, inputs: MoEInputs, m: int) -> None:
        from ..staging import stage_into

        b = self.buf
        stage_into(inputs.x, inputs.topk_idx, inputs.topk_weights, b.x_q, b.x_sf, b.topk_idx, b.topk_weights, m,
                   num_experts=self.g.num_experts, check=False)  # check_inputs ran in stage()

    def launch(self, num_tokens: int, block_m: int | None = None) -> torch.Tensor:
        """The launches on what ``stage`` wrote (num_tokens and block_m checked by the base class's wrapper, then
        by ``moe_decode.check_launch``: no more than were staged; no host sync)."""
        from ..decode import moe_decode

        m = int(num_tokens)
        return moe_decode(self.dw, self.buf, m, self.g.clamp, self.launch_config(m, block_m))

    def run(self, inputs: MoEInputs, num_tokens: int | None = None, block_m: int | None = None) -> torch.Tensor:
        """``FusedBackend.run``; a non-finite y whose cause is a scale byte of the prepared weights (written in place
        after prepare: prepare refuses every such byte) names that byte (tensor, expert, row, group) instead of
        blaming the activations. The search runs on this error path only."""
        try:
            return super().run(inputs, num_tokens, block_m)
        except NonFiniteOutputError as exc:
            experts = sorted(set(inputs.topk_idx[inputs.topk_idx >= 0].tolist()))
            cause = self.dw.bad_scale(experts)
            if cause is None:
                raise
            head = str(exc).split(" although every input was finite")[0]
            raise NonFiniteOutputError(f"{head} although every input was finite; caused by the weights: {cause}") from exc

    # ------------------------------------------------------------------ intermediates
    def poison_intermediates(self) -> None:
        self.buf.poison_()

    def intermediates(self) -> dict:
        b = self.buf
        m = getattr(self, "_staged", 0)
        n = int((b.slot_row[: m * self.g.num_topk] >= 0).sum())
        return {"pool_x": b.x_q[b.row_token[:n].long()].clone(), "l2_in": b.l2_q[:n].view(torch.float8_e4m3fn).clone(),
                "l2_in_sf_rowmajor": b.l2_sf[:n].clone(), "l2_group": self.recipe.l2_group, "block_m": None}


class MegaMoEDecodeTC(MegaMoEDecode):
    """The same path with tensor-core GEMVs (megamoe/decode/triton_tc.py): an FP8 MMA per 32-K scale group,
    the weights as the 64-row operand and up to 16 tokens as its columns. Its own numerics (the tensor cores'
    k32 sums, FP32 promotion): recipe ``megamoe-decode-tc``. Faster than ``megamoe-decode`` at every count from
    1 to 64 tokens (one H200, DeepSeek-V4-Flash: bench/results/2026-12-04_nvidia-h200_decode-tc)."""

    name = "megamoe-decode-tc"
    recipe = MEGAMOE_DECODE_TC
    kernel = MEGAMOE_DECODE_TC.kernel
    in_all = True  # the decode backend (MegaMoEDecode's False is the exact kernel's)
    split_tokens = 1  # tc_launch_config splits L1's K at 1 token: the buffers hold its scratch (3 MB at dsv4)

    @classmethod
    def _device_reasons(cls, major: int, minor: int) -> list[str]:
        return [] if major == 9 else [f"needs SM90 (wgmma FP8), got compute capability {major}.{minor}"]

    fixed_tile = "16 tokens per MMA pass, the N of its tensor-core tile"

    def legal_block_ms(self, num_tokens: int | None = None) -> tuple[int, ...]:
        return ()  # fixed_tile: nothing to choose, so a BLOCK_M asked is refused rather than accepted and dropped

    def launch_config(self, num_tokens: int, block_m: int | None = None):
        from ..decode.tc import tc_launch_config

        self.resolve_block_m(block_m)  # refuses any block_m: the tile is fixed, never a choice silently dropped
        return tc_launch_config(num_tokens, self.g.num_topk)

    def plan(self, num_tokens: int) -> Plan:
        return Plan(16, forced=False, detail={"source": f"fixed: {self.fixed_tile}", "warps": 4})

    def _prepare(self, weights) -> None:
        from ..decode.layout import fold_global_scales
        from ..decode.layout_tc import prepare_tc_weights

        self.kernel_weights = fold_global_scales(weights)
        self.dw = prepare_tc_weights(weights)
