"""sgl-deep-gemm 0.1.5.post1 ``fp8_mega_moe``: FP8 activations x FP8 (128x128 block) experts, SM90.

Weights: FP8BlockWeights (from MXFP4 through ``megamoe.layouts.deepgemm_sm90.to_fp8_block``, lossy,
or given directly), then ``to_deepgemm_sm90_fp8`` (= ``deep_gemm.transform_weights_for_mega_moe_sm90``:
L1 rows gate/up interleaved by 8, scales untouched).

Plans: the package chooses its configuration in C++ (``heuristics/sm90_mega_moe.hpp``) from the local
token count, with no Python override, so nothing can be forced (``legal_block_ms`` is empty). What it
chose is read back: with ``DG_PRINT_CONFIGS=1`` (set before the first import) the heuristic prints
``MegaMoESM90Config(block_m=.., block_n=.., ...)`` once per token count, captured from file descriptor 1
during the build launch; the JIT-generated source in ``DG_JIT_CACHE_DIR`` (default ``~/.deep_gemm``) holds
the kernel's full template arguments, of which two change the numerics:

    kFP8SwapAB          weights as the MMA's M operand (no numerical effect)
    kReuseAccumAsFinal  the running sum stays in the tensor-core accumulator across K blocks
                        (``accumulate="rescale"`` in the reference; hidden >= 7168: "rescale-ratio")

Seen on the H200 (bench/results/*dg-probe*): BLOCK_M 64 x BLOCK_N 128 (swap-AB up to ~128 tokens per
rank, reuse off) for small counts, BLOCK_M 128 x BLOCK_N 256 with reuse on for large ones (small geometry
T >= 300, DeepSeek-V4-Flash T = 8192). ``recipe_for(num_tokens)`` returns the recipe of the plan a launch
of that size runs.

Intermediates: ``SM90SymmBuffer`` exposes ``l1_acts`` (the dispatched pool, e4m3 [P, H]), ``l1_acts_sf``,
``l2_acts`` (the L2 input, e4m3 [P, I]) and ``l2_acts_sf`` (fp32 [P_sf, I/64], row-major; pool row r of
a BLOCK_M block b sits at row b * roundup(BLOCK_M, 128) + r % BLOCK_M).
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import tempfile

import torch

from ..recipe import DEEPGEMM_SM90_FP8, Recipe
from .base import FusedBackend, Plan, kernel_availability


def _import():
    # The C++ heuristic prints its choice (once per token count) only when this is set at first use.
    os.environ.setdefault("DG_PRINT_CONFIGS", "1")
    import deep_gemm

    return deep_gemm


# Template parameters of sm90_fp8_mega_moe_impl, in order (include/deep_gemm/impls/sm90_fp8_mega_moe.cuh).
TEMPLATE_PARAMS = (
    "num_max_tokens_per_rank", "hidden", "intermediate_hidden", "num_experts", "num_topk", "num_experts_per_wave",
    "block_m", "block_n", "block_k", "num_max_pool_tokens", "num_padded_sf_pool_tokens", "num_stages",
    "num_dispatch_threads", "num_non_epilogue_threads", "num_epilogue_threads", "num_sms", "num_ranks",
    "activation_clamp", "fast_math", "epilogue_register_budget", "reuse_accum_as_final", "l2_arrival_counter",
    "l2_epilogue_requires_full_sync", "split_phase_hot_path", "fp8_swap_ab",
)


def source_build_reason(backend: str) -> str:
    """'' unless the imported deep_gemm is the DeepGEMM PR #323 source build (megamoe.fused.deepgemm_build),
    which the FP8 backends are not verified on: they run on sgl-deep-gemm 0.1.5.post1, in a process
    without the build on PYTHONPATH, so a result never names one build while the other ran."""
    from ..provenance import module_provenance

    prov = module_provenance("deep_gemm")
    if prov and prov.get("build"):
        return (f"kernel build mismatch: {backend} is verified on sgl-deep-gemm 0.1.5.post1, but the imported "
                f"deep_gemm is {prov['build'].get('source', 'a source build')} ({prov['file']}); run it in a "
                "process without that build on PYTHONPATH")
    return ""


def parse_config_print(text: str) -> dict:
    """The last ``MegaMoESM90Config(key=value, ...)`` of the heuristic's printout -> {key: int}."""
    found = re.findall(r"MegaMoESM90Config\(([^()]*block_m=[^()]*)\)", text)
    if not found:
        return {}
    out = {}
    for kv in found[-1].split(","):
        k, _, v = kv.strip().partition("=")
        out[k] = int(v) if v.strip().lstrip("-").isdigit() else v.strip()
    return out


def template_instantiation(src: str, kernel: str = "sm90_fp8_mega_moe_impl") -> str | None:
    """The ``<kernel><...>`` instantiation in a JIT source, as written (None if absent)."""
    i = src.find(kernel + "<")
    if i < 0:
        return None
    depth, j = 0, i + len(kernel)
    for j in range(j, len(src)):
        depth += {"<": 1, ">": -1}.get(src[j], 0)
        if depth == 0:
            break
    return src[i : j + 1]


def parse_template_args(src: str, kernel: str = "sm90_fp8_mega_moe_impl",
                        params: tuple[str, ...] = TEMPLATE_PARAMS) -> dict | None:
    """The template arguments of the ``<kernel><...>`` instantiation in a JIT source, named by ``params``."""
    inst = template_instantiation(src, kernel)
    if inst is None:
        return None
    args = [a.strip() for a in inst[len(kernel) + 1 : -1].split(",")]
    if len(args) < len(params):
        return None

    def val(a: str):
        if a in ("true", "false"):
            return a == "true"
        try:
            return int(a)
        except ValueError:
            return a

    return {k: val(a) for k, a in zip(params, args)}


def find_all_kernel_args(config: dict, cache_dir: str | None = None, kernel: str = "sm90_fp8_mega_moe_impl",
                         params: tuple[str, ...] = TEMPLATE_PARAMS, extra: dict | None = None) -> list[dict]:
    """Template arguments of every JIT-built ``kernel`` in DeepGEMM's kernel cache that matches a printed
    config (and ``extra`` template arguments, e.g. the token capacity), in the order the cache is walked."""
    root = cache_dir or os.environ.get("DG_JIT_CACHE_DIR") or os.path.expanduser("~/.deep_gemm")
    keys = ("block_m", "block_n", "block_k", "num_max_pool_tokens", "num_padded_sf_pool_tokens", "num_stages",
            "num_experts_per_wave", "num_dispatch_threads", "num_non_epilogue_threads", "num_epilogue_threads")
    found = []
    for d, _, files in os.walk(root):
        for f in files:
            if not f.endswith((".cu", ".cuh", ".cpp")):
                continue
            try:
                args = parse_template_args(open(os.path.join(d, f), errors="replace").read(), kernel, params)
            except OSError:
                continue
            if (args and all(args.get(k) == config.get(k) for k in keys if k in config)
                    and all(args.get(k) == v for k, v in (extra or {}).items())):
                found.append(args)
    return found


def find_kernel_args(config: dict, cache_dir: str | None = None, kernel: str = "sm90_fp8_mega_moe_impl",
                     params: tuple[str, ...] = TEMPLATE_PARAMS, extra: dict | None = None) -> dict | None:
    """The first of ``find_all_kernel_args``; None if no cached kernel matches."""
    found = find_all_kernel_args(config, cache_dir, kernel, params, extra)
    return found[0] if found else None


def capture_stdout_fd(fn):
    """Run fn() with file descriptor 1 (C/C++ stdout) redirected; returns (result, captured text)."""
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    libc.fflush(None)
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(1)
        os.dup2(tmp.fileno(), 1)
        try:
            res = fn()
        finally:
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode(errors="replace")
    return res, text


def recipe_for_kernel(base: Recipe, args: dict | None, config: dict, hidden: int, mma: str) -> Recipe:
    """The reference recipe of one DeepGEMM configuration. Without the template arguments the reuse
    flag is inferred from the tile (the 128 x 256 tile is the only one seen with it on)."""
    reuse = args["reuse_accum_as_final"] if args else (config.get("block_m") == 128 and config.get("block_n") == 256)
    acc = "promote" if not reuse else ("rescale-ratio" if hidden >= 7168 else "rescale")
    return base.with_(mma=mma, accumulate=acc)


class DeepGEMMFP8(FusedBackend):
    name = "deepgemm-sm90-fp8"
    recipe = DEEPGEMM_SM90_FP8
    weight_format = "fp8_block"
    kernel = "deep_gemm.fp8_mega_moe (sgl-deep-gemm 0.1.5.post1)"
    kernel_module = "deep_gemm"

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        ok, why = kernel_availability(
            _import, "deep_gemm", ("fp8_mega_moe", "get_symm_buffer_for_sm90_mega_moe", "transform_weights_for_mega_moe_sm90"))
        return (False, source_build_reason(cls.name)) if ok and source_build_reason(cls.name) else (ok, why)

    fixed_tile = "sgl-deep-gemm 0.1.5.post1 picks BLOCK_M in C++ from the token count, with no override"

    def legal_block_ms(self, num_tokens: int | None = None) -> tuple[int, ...]:
        return ()  # fixed_tile

    def _prepare(self, weights) -> None:
        from ..layouts.deepgemm_sm90 import fp8_block_weights_for_kernel, to_deepgemm_sm90_fp8

        weights = fp8_block_weights_for_kernel(weights, self.name)
        self.kernel_weights = weights
        (l1, l1_sf), (l2, l2_sf) = to_deepgemm_sm90_fp8(weights)
        self.l1 = (l1.contiguous(), l1_sf.contiguous())
        self.l2 = (l2.contiguous(), l2_sf.contiguous())

    def _allocate(self) -> None:
        dg = _import()
        g = self.g
        self.buf = dg.get_symm_buffer_for_sm90_mega_moe(self.group, g.num_experts, self.capacity, g.num_topk,
                                                        g.hidden, g.intermediate)
        self.y = torch.empty(self.buf.num_max_tokens_per_rank, g.hidden, dtype=torch.bfloat16, device=self.device)

    def _config(self, num_tokens: int) -> dict | None:
        """{'config': printed config, 'template_args': ... or None} of num_tokens, once a launch of it
        went through ``_launch_capturing`` (build() does that); None before."""
        return getattr(self, "_configs", {}).get(int(num_tokens))

    def plan(self, num_tokens: int) -> Plan:
        """The configuration a launch of num_tokens runs: known once build() has seen the heuristic's
        printout for that count."""
        cfg = self._config(num_tokens)
        if not cfg:
            return Plan(block_m=0, forced=False, detail={"source": "deep_gemm C++ heuristic (not yet built)"})
        args = cfg.get("template_args") or {}
        detail = {k: v for k, v in cfg["config"].items() if k != "block_m"}
        detail.update(swap_ab=args.get("fp8_swap_ab"), reuse_accum=args.get("reuse_accum_as_final"),
                      source="DG_PRINT_CONFIGS" + (" + JIT source" if args else ""))
        return Plan(block_m=int(cfg["config"].get("block_m", 0)), forced=False, detail=detail)

    def recipe_for(self, num_tokens: int, mma: str | None = None) -> Recipe:
        """The recipe of the plan a launch of num_tokens runs (accumulation mode from the kernel's
        template arguments). ``mma`` defaults to the recipe's own block-sum model."""
        cfg = self._config(num_tokens)
        if not cfg:
            return super().recipe_for(num_tokens, mma)
        return recipe_for_kernel(self.recipe, cfg.get("template_args"), cfg["config"], self.g.hidden,
                                 mma or self.recipe.mma)

    def _launch_capturing(self, num_tokens: int) -> None:
        """Launch once with fd 1 captured; record the printed configuration and its kernel's arguments."""
        _, text = capture_stdout_fd(lambda: (self.launch(num_tokens), torch.cuda.synchronize()))
        cfg = parse_config_print(text)
        rest = re.sub(r"MegaMoESM90Config\([^\n]*\n?", "", text).strip()
        if rest:
            print(rest, flush=True)  # anything else the package printed (JIT messages) stays visible
        if cfg:
            self.__dict__.setdefault("_configs", {})[int(num_tokens)] = {
                "config": cfg, "template_args": find_kernel_args(cfg)}

    def _build_job(self, num_tokens: int):
        # A launch builds its configuration on first use; warm it with staged padding rows.
        def warm():
            self._stage(self._padding_inputs(), num_tokens)
            self._launch_capturing(num_tokens)

        return ("dg", num_tokens), warm

    def build(self, token_counts, max_workers: int = 1, block_m: int | None = None) -> int:
        return super().build(token_counts, max_workers=1, block_m=block_m)  # launches: one at a time

    allows_zero_tokens = True

    def launch(self, num_tokens: int) -> torch.Tensor:
        dg = _import()
        y = self.y[: int(num_tokens)]
        dg.fp8_mega_moe(y, self.l1, self.l2, self.buf, recipe=(128, 128, 128), activation="swiglu",
                        activation_clamp=float(self.g.clamp), fast_math=True)
        return y

    def poison_intermediates(self) -> None:
        b = self.buf
        for t in (b.l1_acts, b.l2_acts):
            t.view(torch.uint8).fill_(0x7F)
        for t in (b.l1_acts_sf, b.l2_acts_sf):
            if t.dtype.is_floating_point:
                t.fill_(float("nan"))
            else:
                t.view(torch.uint8).fill_(0x7F)
        self.y.fill_(float("nan"))

    def intermediates(self) -> dict:
        b = self.buf
        m = getattr(self, "_staged", None)
        bm = self.plan(m).block_m if m else 0
        return {"pool_x": b.l1_acts.clone(), "l2_in": b.l2_acts.clone(), "l2_in_sf_rowmajor": b.l2_acts_sf.clone(),
                "l2_group": 64, "block_m": bm or None}

    def destroy(self) -> None:
        buf = getattr(self, "buf", None)
        if buf is not None:
            buf.destroy()
