"""Humming, vLLM main's default MoE path on Hopper, as one rank runs it (``HummingIndexedExperts``).

Two backends over the package ``humming-kernels`` (``pip install "megamoe[humming]"``):

    humming-w4a8    FP8 e4m3 activations, one FP32 scale per token per 128 channels (vLLM's
                    VLLM_HUMMING_INPUT_QUANT_CONFIG='{"dtype":"float8e4m3","input_scale_group_size":128}'):
                    the baseline of the Mega MoE pull request ("main default")
    humming-w4a16   bf16 activations (vLLM's other Humming mode)

One launch of m tokens (n = m * K slots), every step on the current stream, no host sync:

    quant     humming.forward.may_quant_input (W4A8): x bf16 [m, H] -> e4m3 [m, H] + fp32 [m, H/128]
    align     slots -> sorted_ids / expert_ids / num_padded, block = the gate/up tuning config's block M
              (megamoe.fused.humming_glue: vLLM's moe_align_block_size)
    gate/up   humming.forward.humming_forward(w13, top_k=K, gemm_type "indexed") -> bf16 [n, 2I]
    SwiGLU    clamped, bf16 [n, I] (humming_glue.swiglu_into), then may_quant_input again (W4A8)
    down      humming_forward(w2, top_k=1) -> bf16 [n, H]
    combine   y = sum over valid slots of slot * routing weight, FP32 FMAs (humming_glue.combine_into)

Weights are prepared once the way vLLM prepares them (``humming.schema.Mxfp4WeightSchema().convert_humming``,
the input schema's ``convert_humming``, ``humming.transform.prepare_layer_config(pad_n_to_multiple=256,
pad_k_to_multiple=128)`` without the tensors, ``prepare_fp16_e8m0_scale``, ``transform_humming_tensors``) from
the checkpoint form (``megamoe.layouts.humming.to_humming_mxfp4``). With FP8 activations the transform rebases
each (expert, sublayer)'s E8M0 bytes into a window of 12 (``megamoe.layouts.humming``): weights below it are
refused, or accepted and rewritten exactly as the kernel rewrites them with ``accept_lossy_scales=True``.

The tuning configuration (tile, stages, MMA) comes from ``humming.tune.get_heuristics_config``, as a list of
row intervals; ``plan(m)`` names the configs the launch of m tokens uses for both GEMMs. A ``block_m`` asked of
``plan`` / ``build`` / ``launch`` picks, for both GEMMs, the config of their lists whose block M it is (the tiles
Humming itself would run at another size), so the matrix can run every tile Humming can be given. Two departures from vLLM's
call, both named in the plan: where the down list's pick for m * K rows has another block M than the slots'
alignment (vLLM would run it and read a misaligned index; ``pick_configs``), the down GEMM gets its list's config
of the aligned block M; and ``VLLM_BATCH_INVARIANT=1`` is honoured as vLLM honours it (tuning lists without
stream-K).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os

import torch

from ..inputs import MoEInputs
from ..recipe import HUMMING_W4A8, HUMMING_W4A16, Recipe
from .base import FusedBackend, LossyScalesOptIn, Plan, cuda_hopper_reason

REQUIRED = ("forward", "transform", "schema", "tune", "layer")
COMPUTE_CONFIG = {"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": "indexed"}  # vLLM's default
W4A8_INPUT = {"dtype": "float8e4m3", "input_scale_group_size": 128}


def batch_invariant_from_env() -> bool:
    """vLLM's ``VLLM_BATCH_INVARIANT`` (an integer, 0 by default), read the way vLLM reads it: with it set,
    Humming's tuning lists hold no stream-K configs and every row's K reduction runs in one CTA."""
    return bool(int(os.environ.get("VLLM_BATCH_INVARIANT", "0")))


def _interval_pick(lst, n: int):
    """The config of a tuning list that holds n rows, by vLLM's rule (lo < n <= hi); None when none does."""
    for lo, hi, c in lst:
        if lo < n <= hi:
            return c
    return None


def pick_configs(tuning13, tuning2, n: int, block_m: int | None = None, who: str = "humming"):
    """(align block M, gate/up config, down config, re-pick note or None) for a launch of n = tokens * K slots.

    vLLM (``HummingIndexedExperts``) aligns the slots to the block M of the gate/up config that holds n rows and
    hands the down GEMM its own list, from which Humming picks by the same rule. The indexed kernel reads
    ``sorted_ids`` / ``expert_ids`` in blocks of its own block M, so where the down list's pick has another
    block M than the align, the down GEMM reads a misaligned index and computes wrong rows
    (docs/kernel-numerics.md, Humming). Here the down GEMM then gets the config of its list with the align's
    block M whose row interval lies nearest n, and the plan says so. At a ``block_m`` asked, both GEMMs take the
    first config of their list with that block M."""
    if block_m is not None:
        def first(lst, which):
            for _, _, c in lst:
                if int(c["block_shape"][0]) == block_m:
                    return c
            raise ValueError(f"{who}: block_m={block_m} is in no {which} tuning config")
        return block_m, first(tuning13, "gate/up"), first(tuning2, "down"), None
    c13 = _interval_pick(tuning13, n)
    c2 = _interval_pick(tuning2, n)
    if c13 is None or c2 is None:
        raise ValueError(f"{who}: no tuning config for {n} rows")
    bm = int(c13["block_shape"][0])
    if int(c2["block_shape"][0]) == bm:
        return bm, c13, c2, None
    same = [(lo, hi, c) for lo, hi, c in tuning2 if int(c["block_shape"][0]) == bm]
    if not same:
        raise ValueError(f"{who}: the down tuning list has no config of block M {bm} (the gate/up list's for {n} "
                         f"rows), so no down config can read the aligned slots")
    lo, hi, c2_new = min(same, key=lambda t: 0 if t[0] < n <= t[1] else min(abs(n - t[0]), abs(n - t[1])))
    note = (f"down config re-picked: Humming's down list gives block M {int(c2['block_shape'][0])} for {n} rows, "
            f"the slots are aligned to {bm} (the gate/up config's), so the config of block M {bm} for rows "
            f"({lo}, {hi}] runs instead")
    return bm, c13, c2_new, note


def _import():
    mod = importlib.import_module("humming")
    for sub in REQUIRED:
        importlib.import_module(f"humming.{sub}")
    return mod


def _config_summary(cfg: dict) -> str:
    """A tuning config in one line: the tile and the options that tell configs apart."""
    keys = ("block_shape", "warp_shape", "num_stages", "mma_type", "use_stream_k", "use_warp_spec")
    return ", ".join(f"{k}={cfg[k]}" for k in keys if k in cfg)


class _Humming(LossyScalesOptIn, FusedBackend):
    """The shared chain; subclasses set the activation type."""

    weight_format = "mxfp4"
    persistent = False
    fused = False
    kernel_module = "humming"
    graph_capturable = True  # every buffer made by allocate(); the chain syncs nothing (captured whole)
    input_config: dict | None = None

    # ------------------------------------------------------------------ availability
    @classmethod
    def availability(cls) -> tuple[bool, str]:
        """Both reasons when both hold: no SM90 GPU, and the package (or triton, for the glue) missing."""
        reasons = []
        why = cuda_hopper_reason()
        if why:
            reasons.append(why)
        try:
            _import()
        except Exception as exc:  # noqa: BLE001
            reasons.append(f"package missing: humming-kernels not importable ({type(exc).__name__}: {exc}); "
                           "pip install 'megamoe[humming]'")
        if importlib.util.find_spec("triton") is None:
            reasons.append("package missing: triton (the align / SwiGLU / combine glue)")
        return (not reasons), "; ".join(reasons)

    # ------------------------------------------------------------------ weights
    def _schemas(self):
        from humming.schema import HummingInputSchema

        return HummingInputSchema.from_config(dict(self.input_config)) if self.input_config else HummingInputSchema()

    def _sublayer(self, name: str, codes: torch.Tensor, scale: torch.Tensor, shape_n: int, shape_k: int,
                  n_stacks: list[int]):
        """One sublayer through Humming's own conversion and transform, as vLLM runs them -> (meta, tensors)."""
        from humming import transform
        from humming.layer import HummingLayerMeta
        from humming.schema import Mxfp4WeightSchema

        e = codes.shape[0]
        ws, tensors = Mxfp4WeightSchema().convert_humming(
            tensors={"weight": codes, "weight_scale": scale}, shape_n_stacks=n_stacks, shape_k_stacks=[shape_k],
            param_dtype=torch.bfloat16, num_experts=e, device=self.device)
        in_schema, _ = self._schemas().convert_humming(tensors=tensors, shape_n_stacks=n_stacks,
                                                       shape_k_stacks=[shape_k], param_dtype=torch.bfloat16,
                                                       num_experts=e, device=self.device)
        config = _layer_config(shape_n, shape_k, ws, in_schema, e, self.device)
        meta = HummingLayerMeta.from_layer_config(config, name)
        meta, tensors = transform.prepare_fp16_e8m0_scale(meta, tensors)
        out = transform.transform_humming_tensors(meta, tensors)
        return meta, out

    def _prepare(self, weights) -> None:
        from ..layouts.humming import check_humming_window, humming_kernel_weights, to_humming_mxfp4

        if weights.l1_global_scale is not None or weights.l2_global_scale is not None:
            from ..layouts.ranges import fold_global_scales

            weights = fold_global_scales(weights)
        self.checkpoint_weights = weights  # the exact values, for the lossy cases' "what was lost"
        if self.recipe.max_scale_span is not None:
            self.decode_loss = check_humming_window(weights, accept_lossy=self.accept_lossy_scales, who=self.name,
                                                    span=self.recipe.max_scale_span)
            # The reference runs on the values the kernel computes with (identical when nothing was rewritten).
            self.kernel_weights = humming_kernel_weights(weights, self.recipe.max_scale_span) if self.decode_loss \
                else weights
        else:
            self.kernel_weights = weights
        self._load(to_humming_mxfp4(weights))

    def _load(self, sub) -> None:
        from humming.tune import get_heuristics_config

        g = self.g
        w13, w2 = sub["w13"], sub["w2"]
        self.meta13, self.w13 = self._sublayer("w13", w13.weight, w13.weight_scale, 2 * g.intermediate, g.hidden,
                                               [g.intermediate, g.intermediate])
        self.meta2, self.w2 = self._sublayer("w2", w2.weight, w2.weight_scale, g.hidden, g.intermediate, [g.hidden])
        self.batch_invariant = batch_invariant_from_env()
        self.compute_config = dict(COMPUTE_CONFIG, use_batch_invariant=self.batch_invariant)
        self.tuning13, self.tuning2 = (get_heuristics_config(m, gemm_type="indexed", device=self.device,
                                                             use_batch_invariant=self.batch_invariant)
                                       for m in (self.meta13, self.meta2))

    # ------------------------------------------------------------------ plans
    def legal_block_ms(self, num_tokens: int | None = None) -> tuple[int, ...]:
        """The block Ms of the gate/up tuning list that the down list has too (known after prepare; before it,
        from a layer config of this geometry, which needs the GPU and the package)."""
        lists = self._tuning_lists()
        if lists is None:
            return ()
        b13 = {int(c["block_shape"][0]) for _, _, c in lists[0]}
        b2 = {int(c["block_shape"][0]) for _, _, c in lists[1]}
        return tuple(sorted(b13 & b2))

    def _tuning_lists(self):
        if hasattr(self, "tuning13"):
            return self.tuning13, self.tuning2
        ok, _ = self.availability()
        if not ok:
            return None
        return _geometry_tuning(self.name, self.g.num_experts, self.g.hidden, self.g.intermediate,
                                json.dumps(self.input_config), batch_invariant_from_env())

    @property
    def fixed_tile(self) -> str:
        """Why no block_m can be chosen when the tuning lists are unknown (legal_block_ms() is then empty)."""
        return "the tiles come from Humming's tuning list, which needs a Hopper GPU and humming-kernels"

    def _configs(self, num_tokens: int, block_m: int | None = None) -> tuple[int, dict, dict]:
        """(align block, gate/up config, down config) of a launch of num_tokens (``pick_configs``; ``block_m``
        already checked against ``legal_block_ms``)."""
        bm, c13, c2, _ = pick_configs(self.tuning13, self.tuning2, int(num_tokens) * self.g.num_topk, block_m,
                                      who=self.name)
        return bm, c13, c2

    def plan(self, num_tokens: int, block_m: int | None = None) -> Plan:
        if not hasattr(self, "tuning13"):
            return Plan(block_m=0, detail={"source": "humming.tune heuristics (not yet prepared)"})
        bm, c13, c2, repicked = pick_configs(self.tuning13, self.tuning2, int(num_tokens) * self.g.num_topk,
                                             block_m, who=self.name)
        detail = {"source": "humming.tune.get_heuristics_config", "tiles": f"gate/up {_config_summary(c13)}; "
                  f"down {_config_summary(c2)}", "gate_up_config": c13, "down_config": c2}
        if self.batch_invariant:
            detail["batch_invariant"] = True  # VLLM_BATCH_INVARIANT=1: no stream-K configs
        if repicked is not None:
            detail["down_repicked"] = repicked
        if self.decode_loss:
            detail["decode_loss"] = self.decode_loss["summary"]
        return Plan(block_m=bm, forced=block_m is not None, detail=detail)

    def _tuning_arg(self, lst, cfg, n: int, block_m: int | None) -> str:
        """The tuning list handed to humming_forward: the whole list, as vLLM hands it, when Humming's own pick
        from it for n rows is cfg; otherwise (a ``block_m`` asked, a re-picked down config) cfg alone."""
        if block_m is None and _interval_pick(lst, n) is cfg:
            return json.dumps(lst)
        return json.dumps([[0, 1 << 30, cfg]])

    # ------------------------------------------------------------------ buffers
    def _allocate(self) -> None:
        g, c, dev = self.g, self.capacity, self.device
        n = c * g.num_topk
        bm_max = max([int(cfg["block_shape"][0]) for _, _, cfg in self.tuning13] + [1])
        from .humming_glue import padded_slots_bound

        slots = padded_slots_bound(c, g.num_topk, g.num_experts, bm_max)
        fp8 = self.input_config is not None
        self.x = torch.zeros(c, g.hidden, dtype=torch.bfloat16, device=dev)
        self.topk_idx = torch.full((c, g.num_topk), -1, dtype=torch.int64, device=dev)
        self.topk_weights = torch.zeros(c, g.num_topk, dtype=torch.float32, device=dev)
        self.sorted_ids = torch.empty(slots, dtype=torch.int32, device=dev)
        self.expert_ids = torch.empty(slots, dtype=torch.int32, device=dev)
        self.num_padded = torch.zeros(1, dtype=torch.int32, device=dev)
        self.counts = torch.zeros(g.num_experts, dtype=torch.int32, device=dev)
        self.cursor = torch.zeros(g.num_experts, dtype=torch.int32, device=dev)
        self.x_q = torch.empty(c, g.hidden, dtype=torch.float8_e4m3fn, device=dev) if fp8 else None
        self.gate_up = torch.empty(n, 2 * g.intermediate, dtype=torch.bfloat16, device=dev)
        self.act = torch.empty(n, g.intermediate, dtype=torch.bfloat16, device=dev)
        self.act_q = torch.empty(n, g.intermediate, dtype=torch.float8_e4m3fn, device=dev) if fp8 else None
        self.down = torch.empty(n, g.hidden, dtype=torch.bfloat16, device=dev)
        self.y = torch.empty(c, g.hidden, dtype=torch.bfloat16, device=dev)
        # Stream-K's locks, one set per GEMM's layer as vLLM's layer has (humming.layer.HummingLayer).
        self.locks = torch.zeros(2048, dtype=torch.int32, device=dev)

    def _stage(self, inputs: MoEInputs, m: int) -> None:
        t = inputs.num_tokens
        self.x[:t].copy_(inputs.x)
        self.x[t:m].zero_()
        self.topk_idx[:t].copy_(inputs.topk_idx)
        self.topk_idx[t:m].fill_(-1)
        self.topk_weights[:t].copy_(inputs.topk_weights)
        self.topk_weights[t:m].zero_()

    def _build_job(self, num_tokens: int, block_m: int | None = None):
        bm, c13, c2 = self._configs(num_tokens, block_m)

        def warm():  # Humming JIT-compiles every config of the tuning list a GEMM is handed, at its first call
            self._stage(self._padding_inputs(), num_tokens)
            self._staged = num_tokens
            self.launch(num_tokens, block_m)
            torch.cuda.synchronize()

        # block_m in the key too: a launch at one hands Humming that config alone, the plan's own the whole list, and
        # each JIT-compiles what it is handed
        return ("humming", bm, block_m, json.dumps([c13, c2], sort_keys=True, default=str)), warm

    # ------------------------------------------------------------------ run
    def _quant(self, meta, x: torch.Tensor, out: torch.Tensor | None):
        from humming.forward import may_quant_input

        if out is None:
            return x, None
        return may_quant_input(meta, x, quanted_input=out)

    def launch(self, num_tokens: int, block_m: int | None = None) -> torch.Tensor:
        """The whole chain on what ``stage`` wrote, at ``block_m`` -> y [num_tokens, H] bf16 (a view of the output
        buffer)."""
        from humming.forward import humming_forward

        from .humming_glue import align_block_size, combine_into, swiglu_into

        m = int(num_tokens)
        if m != getattr(self, "_staged", None):
            raise ValueError(f"{self.name}: launch({m}) but the last stage() staged {getattr(self, '_staged', None)} "
                             "tokens")
        g, k = self.g, self.g.num_topk
        n = m * k
        y = self.y[:m]
        if m == 0:
            return y
        bm, c13, c2 = self._configs(m, block_m)
        idx = self.topk_idx[:m]
        align_block_size(idx, g.num_experts, bm, sorted_ids=self.sorted_ids, expert_ids=self.expert_ids,
                         num_padded=self.num_padded, counts=self.counts, cursor=self.cursor)
        common = dict(sorted_ids=self.sorted_ids, expert_ids=self.expert_ids, num_tokens_padded=self.num_padded,
                      locks=self.locks, valid_shape_m=n, compute_config=json.dumps(self.compute_config))
        xq, xs = self._quant(self.meta13, self.x[:m], None if self.x_q is None else self.x_q[:m])
        humming_forward(self.meta13, xq, self.w13["weight"], weight_scale=self.w13.get("weight_scale"),
                        weight_scale_2=self.w13.get("weight_scale_2"), outputs=self.gate_up[:n], input_scale=xs,
                        top_k=k, tuning_config=self._tuning_arg(self.tuning13, c13, n, block_m), **common)
        swiglu_into(self.gate_up[:n], self.act[:n], float(g.clamp))
        aq, as_ = self._quant(self.meta2, self.act[:n], None if self.act_q is None else self.act_q[:n])
        humming_forward(self.meta2, aq, self.w2["weight"], weight_scale=self.w2.get("weight_scale"),
                        weight_scale_2=self.w2.get("weight_scale_2"), outputs=self.down[:n], input_scale=as_,
                        top_k=1, tuning_config=self._tuning_arg(self.tuning2, c2, n, block_m), **common)
        combine_into(self.down[:n].view(m, k, g.hidden), self.topk_weights[:m], idx, y)
        return y

    def poison_intermediates(self) -> None:
        for t in (self.gate_up, self.act, self.down, self.y):
            t.fill_(float("nan"))

    # ------------------------------------------------------------------ broken layouts (the matrix's negative controls)
    def break_layout(self, kind: str):
        """Swap in a deliberately broken weight layout; returns a function that restores the real one.
        gate-up-not-interleaved: gate/up handed over as up | gate (the kernel then gates with the up rows);
        scale-off-by-one: the down GEMM's weight scale bytes one binade high."""
        old = (self.w13, self.w2)
        if kind == "gate-up-not-interleaved":
            from ..layouts.humming import to_humming_mxfp4

            w13 = to_humming_mxfp4(self.kernel_weights.to(self.device))["w13"]
            i = self.g.intermediate
            swap = lambda t: torch.cat([t[:, i:], t[:, :i]], dim=1).contiguous()  # noqa: E731
            _, self.w13 = self._sublayer("w13", swap(w13.weight), swap(w13.weight_scale), 2 * i, self.g.hidden, [i, i])
        elif kind == "scale-off-by-one":  # every E8M0 byte of the down GEMM's scales + 1, whatever their layout
            w2 = dict(self.w2)
            ws = w2["weight_scale"]
            w2["weight_scale"] = (ws.view(torch.uint8).clamp(max=253) + 1).view(ws.dtype)
            self.w2 = w2
        else:
            raise ValueError(f"{self.name}: unknown broken layout {kind!r}")

        def restore():
            self.w13, self.w2 = old

        return restore


def _layer_config(shape_n: int, shape_k: int, weight_schema, input_schema, num_experts: int, device):
    """Humming's layer config as vLLM asks for it: padded to 256 rows and 128 K, bf16, without the tensors (so the
    W4A8 rebase keeps one window per expert and sublayer)."""
    from humming import transform

    return transform.prepare_layer_config(shape_n=shape_n, shape_k=shape_k, weight_schema=weight_schema,
                                          input_schema=input_schema, num_experts=num_experts, pad_n_to_multiple=256,
                                          pad_k_to_multiple=128, torch_dtype=torch.bfloat16, device=device)


@functools.lru_cache(maxsize=None)
def _geometry_tuning(name: str, e: int, h: int, i: int, input_config: str, batch_invariant: bool = False):
    """The tuning lists of a geometry from its layer configs alone (no weights), cached per geometry."""
    from humming.schema import HummingInputSchema, Mxfp4WeightSchema
    from humming.tune import get_heuristics_config

    cfg = json.loads(input_config)
    in_schema = HummingInputSchema.from_config(cfg) if cfg else HummingInputSchema()
    ws = Mxfp4WeightSchema().to_humming_schema(torch.bfloat16)
    dev = torch.device("cuda", torch.cuda.current_device())
    out = []
    for n, k in ((2 * i, h), (h, i)):
        config = _layer_config(n, k, ws, in_schema, e, dev)
        out.append(get_heuristics_config(config, gemm_type="indexed", device=dev, use_batch_invariant=batch_invariant))
    return tuple(out)


class HummingW4A8(_Humming):
    name = "humming-w4a8"
    recipe: Recipe = HUMMING_W4A8
    kernel = HUMMING_W4A8.kernel
    input_config = W4A8_INPUT


class HummingW4A16(_Humming):
    name = "humming-w4a16"
    recipe: Recipe = HUMMING_W4A16
    kernel = HUMMING_W4A16.kernel
    input_config = None
