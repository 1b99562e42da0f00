"""DeepGEMM SM90 FP8 x FP4 ``fp8_fp4_mega_moe`` (DeepGEMM pull request #323 / sgl-project pull request #53).

No installable package ships it: build it from source with ``scripts/build_deepgemm.sh`` (the pin is in
``megamoe.fused.deepgemm_build``) and put the build first on ``PYTHONPATH``. One ``deep_gemm`` is imported per
process, so this backend and the FP8 ones (sgl-deep-gemm 0.1.5.post1) run in different processes; results
name the build that ran (``provenance()``).

Weights: MXFP4 -> ``megamoe.layouts.deepgemm_sm90.to_deepgemm_sm90_fp4`` (K-major nibbles, gate/up rows
interleaved by 8, UE8M0 bytes packed 4 per int32; byte-equal to the package's
``transform_weights_for_mega_moe_sm90_fp4``). The kernel decodes each (scale byte, code) pair through a
constant 256 x 8 table of e4m3 bytes (e4m3 round-to-nearest of e2m1 x 2**(b-127)). That is exact only for
scale bytes 119..133 (``Recipe.min_scale_byte`` .. ``max_scale_byte``); below, the smallest codes round
(bytes <= 114 decode to all zeros); above, the largest codes wrap into negative or NaN bytes. The kernel has
no per-expert global scale, so nothing outside the window can be rebased exactly: ``prepare`` refuses such
weights (message: expert, tensor, bytes, how many weights would change) unless ``accept_lossy_scales=True``
is given, which accepts bytes BELOW the window (never above: those wrap), measures what the decode loses
(``decode_loss``) and reports it in every result (``Plan.detail``, matrix rows, sweep rows).

Plans: chosen in C++ from the token count (no override). With ``DG_PRINT_CONFIGS=1`` the heuristic prints
``MegaMoESM90FP4Config(..., swap_ab=.., ...): MegaMoESM90Config(block_m=.., block_n=.., num_stages=..)`` once
per configuration; ``build`` launches each token count once with file descriptor 1 captured and keeps that
printout plus the kernel's template arguments from the JIT source (``find_all_kernel_args``), so ``plan(T)``
reports BLOCK_M, BLOCK_N, stages, swap-AB and the FP4 decode options of the launch. Options the printout does
not name are known only where every cached kernel matching the printout agrees on them; the others are
listed in ``ambiguous_template_args`` (``agreed_template_args``).

Intermediates: the buffer exposes ``l1_acts`` (pool e4m3 [P, H]), ``l2_acts`` (L2 input e4m3 [P, I]) and
``l2_acts_sf`` (fp32, MN-major storage seen through a [P_sf, I/64] view; the scale of pool row r is row r).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import warnings

import torch

from ..recipe import DEEPGEMM_SM90_FP4
from .base import FusedBackend, LossyScalesOptIn, Plan, kernel_availability
from .deepgemm_build import JIT_CACHE, PIN, SM90_FP4_ENTRY_POINTS
from .deepgemm_fp8 import capture_stdout_fd, find_all_kernel_args, parse_config_print

KERNEL_NAME = "sm90_fp8_fp4_mega_moe_impl"
# Template parameters of sm90_fp8_fp4_mega_moe_impl, in order (impls/sm90_fp8_fp4_mega_moe.cuh at the pin).
TEMPLATE_PARAMS = (
    "num_max_tokens_per_rank", "hidden", "intermediate_hidden", "num_experts", "num_topk", "num_experts_per_wave",
    "block_m", "block_n", "block_k", "num_max_pool_tokens", "num_padded_sf_pool_tokens", "num_stages",
    "num_dispatch_threads", "num_non_epilogue_threads", "num_epilogue_threads", "num_sms", "num_ranks",
    "activation_clamp", "fast_math", "wide_load_decode", "math_wg_participates_in_decode",
    "num_math_wg_decode_warps", "first_decode_assist_warp", "early_b_decode", "decode_done_mbarrier",
    "l2_arrival_counter", "ss_nsplit", "swap_ab", "swap_ab_fast_amax",
)


# Options the heuristic's printout names for each launch; the kernel's other decode options are read from
# the JIT source of the cached kernel that matches the printout.
PRINTED_OPTIONS = ("early_b_decode", "decode_done_mbarrier", "swap_ab", "swap_ab_fast_amax")
JIT_ONLY_OPTIONS = ("wide_load_decode", "math_wg_participates_in_decode", "num_math_wg_decode_warps",
                    "first_decode_assist_warp", "l2_arrival_counter", "ss_nsplit")

_SEEN_CONFIGS: dict = {}  # (E, H, I, K, ranks, capacity, tokens, swap-AB switch) -> what the heuristic printed


def agreed_template_args(matches: list[dict]) -> dict | None:
    """The template arguments every matching cached kernel agrees on; None without a match.

    The match compares the printed configuration and options only, so kernels that differ in an option
    the printout does not name (DeepSeek-V4-Flash T = 8 and T = 16 differ in ``wide_load_decode`` and
    ``l2_arrival_counter`` alone) match alike. Such arguments are left out and listed under
    ``"ambiguous"`` rather than read from whichever kernel the cache walk met first."""
    if not matches:
        return None
    first, rest = matches[0], matches[1:]
    out = {k: v for k, v in first.items() if all(m.get(k) == v for m in rest)}
    ambiguous = sorted(k for k in first if k not in out)
    return {**out, "ambiguous": ambiguous} if ambiguous else out


def sm90_fp4_missing(dg) -> list[str]:
    """Names of the SM90 FP8 x FP4 entry points the given deep_gemm module lacks."""
    return [a for a in SM90_FP4_ENTRY_POINTS if not hasattr(dg, a)]


@functools.cache  # once per process: every launch calls it, and the lookup below touches the filesystem
def _import():
    """Import deep_gemm with the heuristic's printout on and, for a megamoe source build, its own JIT cache
    (so its kernels never mix with another deep_gemm's in ~/.deep_gemm)."""
    os.environ.setdefault("DG_PRINT_CONFIGS", "1")
    spec = importlib.util.find_spec("deep_gemm")
    if spec is not None and spec.origin:
        root = os.path.dirname(os.path.dirname(spec.origin))
        if os.path.exists(os.path.join(os.path.dirname(spec.origin), "BUILD.json")):
            os.environ.setdefault("DG_JIT_CACHE_DIR", os.path.join(root, JIT_CACHE))
    import deep_gemm

    return deep_gemm


def missing_patches_warning(build: dict | None) -> str:
    """'' when the imported deep_gemm is a megamoe build carrying every patch of the pin (``build``: its
    BUILD.json, as ``megamoe.provenance`` reads it); else a warning naming what it lacks."""
    have = {p.get("name") for p in (build or {}).get("patches", [])}
    missing = [name for name in PIN.patches if name not in have]
    if not missing:
        return ""
    what = "this deep_gemm is not a megamoe build" if build is None else "this build lacks megamoe's patches"
    return (f"warning: {what} ({', '.join(missing)}): without the proxy fences identical launches can differ "
            "(measured on the H200, docs/deepgemm-fp4.md); rebuild with scripts/build_deepgemm.sh")


def parse_fp4_config_key(text: str) -> dict:
    """The last ``MegaMoESM90FP4Config(key=value, ...)`` of the printout -> {key: int | bool | str}."""
    found = re.findall(r"MegaMoESM90FP4Config\(([^()]*)\)", text)
    out: dict = {}
    for kv in (found[-1].split(",") if found else []):
        k, _, v = kv.strip().partition("=")
        v = v.strip()
        out[k] = {"true": True, "false": False}.get(v, int(v) if v.lstrip("-").isdigit() else v)
    return out


class DeepGEMMFP4(LossyScalesOptIn, FusedBackend):
    name = "deepgemm-sm90-fp4"
    recipe = DEEPGEMM_SM90_FP4
    weight_format = "mxfp4"
    kernel = "deep_gemm.fp8_fp4_mega_moe on SM90 (DeepGEMM PR #323, source build)"
    kernel_module = "deep_gemm"
    allows_zero_tokens = True

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        ok, why = kernel_availability(_import, "deep_gemm", SM90_FP4_ENTRY_POINTS)
        if not ok and why.startswith("kernel missing"):
            why += (" (the SM90 FP8 x FP4 Mega MoE is DeepGEMM PR #323: build it with scripts/build_deepgemm.sh "
                    "and put it first on PYTHONPATH)")
        if ok:  # runs, but say so when it is the pull request without the fences (a known race)
            why = cls.patch_warning()
        return ok, why

    @classmethod
    def patch_warning(cls) -> str:
        """``missing_patches_warning`` of the deep_gemm this process imported ('' for a patched build)."""
        _import()
        return missing_patches_warning((cls.provenance() or {}).get("build"))

    @classmethod
    def synthetic_weights(cls, weights):
        """Random weights moved into the decode window: each (expert, tensor) by one power of two."""
        from ..layouts.fp4_window import shift_into_window

        return shift_into_window(weights, cls.recipe)

    fixed_tile = "DeepGEMM picks BLOCK_M in C++ from the token count, with no override"

    def legal_block_ms(self, num_tokens: int | None = None) -> tuple[int, ...]:
        return ()  # fixed_tile

    # ------------------------------------------------------------------ weights and buffer
    def _prepare(self, weights) -> None:
        from ..layouts.deepgemm_sm90 import to_deepgemm_sm90_fp4
        from ..layouts.fp4_window import check_fp4_window

        if weights.l1_global_scale is not None or weights.l2_global_scale is not None:
            from ..layouts.ranges import fold_global_scales

            weights = fold_global_scales(weights)
        self.decode_loss = check_fp4_window(weights, self.recipe, accept_below=self.accept_lossy_scales,
                                            who=self.name)
        self.kernel_weights = weights
        (l1, l1_sf), (l2, l2_sf) = to_deepgemm_sm90_fp4(weights, check=False)  # window checked above
        self.l1, self.l2 = (l1, l1_sf), (l2, l2_sf)

    def _allocate(self) -> None:
        g = self.g
        warning = self.patch_warning()
        if warning:  # it runs (to measure the pull request as it is), but never without saying so
            warnings.warn(f"{self.name}: {warning}", RuntimeWarning, stacklevel=2)
        self.buf = _import().get_symm_buffer_for_sm90_mega_moe(self.group, g.num_experts, self.capacity,
                                                               g.num_topk, g.hidden, g.intermediate)
        self.y = torch.empty(self.buf.num_max_tokens_per_rank, g.hidden, dtype=torch.bfloat16, device=self.device)

    # ------------------------------------------------------------------ plans
    def _config(self, num_tokens: int) -> dict | None:
        return getattr(self, "_configs", {}).get(int(num_tokens))

    def plan(self, num_tokens: int) -> Plan:
        """The configuration a launch of num_tokens runs, known once ``build`` launched that count."""
        cfg = self._config(num_tokens)
        loss = {"decode_loss": self.decode_loss["summary"]} if self.decode_loss else {}
        if not cfg:
            return Plan(block_m=0, detail={"source": "deep_gemm C++ heuristic (not yet built)", **loss})
        args = cfg.get("template_args") or {}
        detail = {k: v for k, v in cfg["config"].items() if k != "block_m"}
        detail.update({k: v for k, v in cfg["key"].items() if k in PRINTED_OPTIONS})
        detail.update({k: args[k] for k in JIT_ONLY_OPTIONS if k in args})
        if args.get("ambiguous"):
            detail["ambiguous_template_args"] = args["ambiguous"]
        detail.update(source="DG_PRINT_CONFIGS" + (" + JIT source" if args else ""), **loss)
        return Plan(block_m=int(cfg["config"].get("block_m", 0)), detail=detail)

    def _launch_capturing(self, num_tokens: int) -> None:
        """Launch once with fd 1 captured; keep the printed configuration and its kernel's template arguments."""
        _, text = capture_stdout_fd(lambda: (self.launch(num_tokens), torch.cuda.synchronize()))
        cfg, key = parse_config_print(text), parse_fp4_config_key(text)
        rest = re.sub(r"MegaMoESM90FP4Config\([^\n]*\n?", "", text).strip()
        if rest:
            print(rest, flush=True)  # anything else the package printed (JIT messages) stays visible
        # The package prints each configuration once per process: a second backend of the same shape and
        # capacity sees no printout, so what was read is kept process-wide, by what the heuristic reads.
        shape = (self.g.num_experts, self.g.hidden, self.g.intermediate, self.g.num_topk, self.num_ranks,
                 self.buf.num_max_tokens_per_rank, int(num_tokens), os.environ.get("DG_SM90_FP4_SWAP_AB", "1"))
        if cfg:
            printed = {k: key[k] for k in PRINTED_OPTIONS if k in key}
            args = agreed_template_args(find_all_kernel_args(
                cfg, kernel=KERNEL_NAME, params=TEMPLATE_PARAMS,
                extra={"num_max_tokens_per_rank": self.buf.num_max_tokens_per_rank, **printed}))
            _SEEN_CONFIGS[shape] = {"config": cfg, "key": key, "template_args": args}
        if shape in _SEEN_CONFIGS:
            self.__dict__.setdefault("_configs", {})[int(num_tokens)] = _SEEN_CONFIGS[shape]

    def _build_job(self, num_tokens: int):
        def warm():  # a launch builds its configuration on first use; warm it with staged padding rows
            self._stage(self._padding_inputs(), num_tokens)
            self._launch_capturing(num_tokens)

        return ("dg-fp4", num_tokens), warm

    # ------------------------------------------------------------------ run
    def launch(self, num_tokens: int) -> torch.Tensor:
        y = self.y[: int(num_tokens)]
        _import().fp8_fp4_mega_moe(y, self.l1, self.l2, self.buf, activation_clamp=float(self.g.clamp),
                                   fast_math=True)
        return y

    def poison_intermediates(self) -> None:
        b = self.buf
        for t in (b.l1_acts, b.l2_acts):
            t.view(torch.uint8).fill_(0x7F)
        b.l2_acts_sf.fill_(float("nan"))
        self.y.fill_(float("nan"))

    def intermediates(self) -> dict:
        b = self.buf
        m = getattr(self, "_staged", None)
        return {"pool_x": b.l1_acts.clone(), "l2_in": b.l2_acts.clone(),
                "l2_in_sf_pool": b.l2_acts_sf.float().contiguous(), "l2_group": 64,
                "block_m": (self.plan(m).block_m or None) if m else None}

    def destroy(self) -> None:
        buf = getattr(self, "buf", None)
        if buf is not None:
            buf.destroy()


def plan_record(be: DeepGEMMFP4, token_counts) -> list[dict]:
    """[{tokens, block_m, ...plan detail}] for counts ``build`` has launched (JSON-ready)."""
    out = []
    for t in token_counts:
        p = be.plan(t)
        out.append(json.loads(json.dumps({"tokens": int(t), "block_m": p.block_m, **p.detail}, default=str)))
    return out
