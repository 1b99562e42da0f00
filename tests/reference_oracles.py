"""Dense per-token oracles of the eager reference (tests/test_reference.py), written without the pipeline's
code: a plain loop over tokens and slots (no dispatch, no pool, no batching).

    dense_exact_oracle   float64 throughout, weights via formats.dequantize_mxfp4
    kernel_oracle        replays one recipe's quantization points on one (token, slot) at a time: FP8
                         staging, weight decode rule, per-K-block promotion, SwiGLU, routing weight,
                         requant, bf16 per slot, FP32 slot-ordered combine
    rebase_scales, random_byte_weights   weight sets for the exactness and byte-coverage cases
"""

from __future__ import annotations

import math
import struct

import torch

from megamoe import formats
from megamoe.recipe import get_recipe
from megamoe.weights import FP8BlockWeights, MXFP4Weights

INV448 = torch.tensor(struct.unpack("<f", struct.pack("<f", 1 / 448))[0], dtype=torch.float32)
F32 = torch.float32


# ------------------------------------------------------------------------------------ oracles
_DEQ: dict = {}


def mxfp4_values(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """formats.dequantize_mxfp4, memoised per tensor (the dsv4-flash experts are 8M values each)."""
    key = (packed.data_ptr(), packed.shape, scale.data_ptr())
    if key not in _DEQ:
        _DEQ[key] = formats.dequantize_mxfp4(packed, scale)
    return _DEQ[key]


def dense_expert_weights_f64(weights, e: int):
    """Expert e as float64 (w1 [2I, H], w2 [H, I]), straight from the stored format."""
    if isinstance(weights, FP8BlockWeights):
        def deq(q, s):
            return q.double() * s.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
        return deq(weights.l1[e], weights.l1_scale[e]), deq(weights.l2[e], weights.l2_scale[e])
    w1 = mxfp4_values(weights.l1[e], weights.l1_scale[e]).double()
    w2 = mxfp4_values(weights.l2[e], weights.l2_scale[e]).double()
    if weights.l1_global_scale is not None:
        w1 = w1 * float(weights.l1_global_scale[e])
    if weights.l2_global_scale is not None:
        w2 = w2 * float(weights.l2_global_scale[e])
    return w1, w2


def dense_exact_oracle(x, topk_idx, topk_weights, weights, g) -> torch.Tensor:
    """y[t] = sum_k w[t,k] * W2[e] @ (silu(min(W1g x, c)) * clamp(W1u x, -c, c)), float64."""
    t_, h = x.shape
    i = g.intermediate
    cache = {}
    y = torch.zeros(t_, h, dtype=torch.float64)
    for t in range(t_):
        for k in range(topk_idx.shape[1]):
            e = int(topk_idx[t, k])
            if e < 0:
                continue
            if e not in cache:
                cache[e] = dense_expert_weights_f64(weights, e)
            w1, w2 = cache[e]
            hh = w1 @ x[t].double()
            gate = hh[:i].clamp(max=g.clamp)
            up = hh[i:].clamp(-g.clamp, g.clamp)
            v = gate * torch.sigmoid(gate) * up
            y[t] += float(topk_weights[t, k]) * (w2 @ v)
    return y


def _e4m3(v: torch.Tensor) -> torch.Tensor:
    return v.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()


def _pow2_ceil(y: float) -> float:
    m, ex = math.frexp(y)
    return math.ldexp(1.0, ex - 1 if m == 0.5 else ex)


def _stage_row(xr: torch.Tensor, recipe):
    """One token: x [H] -> (e4m3 values [H], scales [H/gran]) per the recipe."""
    gran = recipe.x_gran
    xs, sfs = [], []
    for g0 in range(0, xr.numel(), gran):
        grp = xr[g0 : g0 + gran].float()
        amax = torch.maximum(grp.abs().max(), torch.tensor(1e-4, dtype=F32))
        sf = amax * INV448  # fp32 multiply, not a division
        if recipe.x_scale == "ue8m0":
            sf = torch.tensor(_pow2_ceil(float(sf)), dtype=F32)
        xs.append(_e4m3(grp * (torch.tensor(1.0, dtype=F32) / sf)))
        sfs.append(sf)
    return torch.cat(xs), torch.stack(sfs)


def _decode_weight(w: torch.Tensor, rule: str) -> torch.Tensor:
    """Exact MXFP4 values (fp32) -> what the MMA reads (e2m1 * 2**s has 2 significant bits, so it is
    exact in e4m3's normal range; only the ends need a rule)."""
    if rule == "e4m3_flush_saturate":
        return torch.where(w.abs() < 2.0**-6, torch.zeros_like(w), w).clamp(-448, 448)
    if rule == "e4m3_rn":
        sub = torch.round(w.double() * 512) / 512  # e4m3 subnormals are k * 2**-9, RNE via round-half-even
        return torch.where(w.abs() < 2.0**-6, sub.float(), w).clamp(-448, 448)
    return w


def _promoted_row(a, a_sf, a_gran, b, b_sf, pk) -> torch.Tensor:
    """One row: acc[n] = fma(fl32(a_sf[kb] * b_sf[n/128, kb]), fl32(exact block dot), acc[n]), kb ascending."""
    n, k = b.shape
    acc = torch.zeros(n, dtype=F32)
    for kb in range(k // pk):
        sl = slice(kb * pk, (kb + 1) * pk)
        partial = (b[:, sl].double() @ a[sl].double()).float()  # exact in float64, one rounding
        s = a_sf[(kb * pk) // a_gran].reshape(1)
        if b_sf is not None:
            s = s * b_sf[torch.arange(n) // 128, (kb * pk) // 128]  # fp32 product
        acc = (s.double() * partial.double() + acc.double()).float()
    return acc


def _requant_row(vw: torch.Tensor, recipe):
    gsz = recipe.l2_group
    qs, sfs = [], []
    for g0 in range(0, vw.numel(), gsz):
        grp = vw[g0 : g0 + gsz]
        amax = grp.abs().max()
        if recipe.l2_scale == "pow2_ceil":
            y = float(amax * INV448)
            if y == 0:
                qs.append(torch.zeros_like(grp))
                sfs.append(torch.tensor(0.0))
                continue
            sf = torch.tensor(_pow2_ceil(y), dtype=F32)
        else:
            sf = torch.maximum(amax, torch.tensor(recipe.l2_amax_floor, dtype=F32)) * INV448
        qs.append(_e4m3(grp * (torch.tensor(1.0, dtype=F32) / sf)))
        sfs.append(sf)
    return torch.cat(qs), torch.stack(sfs)


def kernel_oracle(x, topk_idx, topk_weights, weights, g, recipe) -> tuple[torch.Tensor, dict]:
    """Replays ``recipe`` one (token, slot) at a time. Returns (y bf16 [T, H], per-slot stages)."""
    recipe = get_recipe(recipe)
    t_, h = x.shape
    i = g.intermediate
    decoded = {}
    y = torch.zeros(t_, h, dtype=torch.bfloat16)
    stages = {}
    for t in range(t_):
        xq, xsf = _stage_row(x[t], recipe)
        acc = torch.zeros(h, dtype=F32)
        for k in range(topk_idx.shape[1]):
            e = int(topk_idx[t, k])
            if e < 0:
                continue
            if e not in decoded:
                if isinstance(weights, FP8BlockWeights):
                    decoded[e] = (weights.l1[e].float(), weights.l1_scale[e], weights.l2[e].float(), weights.l2_scale[e])
                else:
                    w1 = mxfp4_values(weights.l1[e], weights.l1_scale[e])
                    w2 = mxfp4_values(weights.l2[e], weights.l2_scale[e])
                    decoded[e] = (_decode_weight(w1, recipe.weight_decode).double(), None,
                                  _decode_weight(w2, recipe.weight_decode).double(), None)  # exact in float64
            w1, w1_sf, w2, w2_sf = decoded[e]
            hh = _promoted_row(xq, xsf, recipe.x_gran, w1, w1_sf, min(recipe.promote_k, recipe.x_gran))
            if weights.format == "mxfp4" and weights.l1_global_scale is not None:
                hh = hh * weights.l1_global_scale[e]
            gate, up = hh[:i], hh[i:]
            if recipe.gate_up_bf16:
                gate, up = gate.bfloat16().float(), up.bfloat16().float()
            gate = gate.clamp(max=g.clamp)
            up = up.clamp(-g.clamp, g.clamp)
            v = gate * (1.0 / (1.0 + torch.exp(-gate))) * up
            vw = v * topk_weights[t, k]
            q, qsf = _requant_row(vw, recipe)
            out = _promoted_row(q, qsf, recipe.l2_group, w2, w2_sf, min(128, recipe.l2_group, recipe.promote_k))
            if weights.format == "mxfp4" and weights.l2_global_scale is not None:
                out = out * weights.l2_global_scale[e]
            out = out.bfloat16()
            acc = acc + out.float()  # slots ascending, masked ones skipped
            stages[(t, k)] = {"x_q": xq, "x_sf": xsf, "l1_out": hh, "l2_in": q, "l2_in_sf": qsf, "l2_out": out}
        y[t] = acc.bfloat16()
    return y, stages


def rebase_scales(weights: MXFP4Weights, lo: int = 122, hi: int = 133) -> MXFP4Weights:
    """Independent exact rebase: per expert and layer, bytes += s, global scale 2**-s (nonzero groups in [lo, hi])."""
    out = {}
    for name in ("l1", "l2"):
        packed, sb = getattr(weights, name), getattr(weights, f"{name}_scale").to(torch.int32)
        nz = (formats.unpack_e2m1(packed) & 7).view(*packed.shape[:-1], -1, 16 * 2).amax(-1) > 0
        shifts = []
        for e in range(weights.num_experts):
            b = sb[e][nz[e]]
            s = lo - int(b.min())
            assert int(b.max()) + s <= hi, "test weights too spread to rebase"
            shifts.append(s)
        s_t = torch.tensor(shifts, dtype=torch.int32)[:, None, None]
        out[f"{name}_scale"] = torch.where(nz, sb + s_t, torch.full_like(sb, 127)).to(torch.uint8)
        out[f"{name}_global_scale"] = torch.tensor([2.0**-s for s in shifts], dtype=F32)
    return MXFP4Weights(weights.l1, out["l1_scale"], weights.l2, out["l2_scale"], out["l1_global_scale"], out["l2_global_scale"])


def random_byte_weights(g, seed: int) -> MXFP4Weights:
    """Uniform random code bytes, scale bytes 122..124 (2**-5 .. 2**-3): legal for every FP4 recipe."""
    gen = torch.Generator().manual_seed(seed)
    e, h, i = g.num_experts, g.hidden, g.intermediate

    def rb(lo, hi, *shape):
        return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int32).to(torch.uint8)

    return MXFP4Weights(rb(0, 256, e, 2 * i, h // 2), rb(122, 125, e, 2 * i, h // 32), rb(0, 256, e, h, i // 2), rb(122, 125, e, h, i // 32))
