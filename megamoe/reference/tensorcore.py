"""How an SM90 FP8 tensor core sums one K block, emulated bit for bit (when the model's parameters are right).

A ``wgmma ... .f32.e4m3.e4m3`` does not add its products in IEEE FP32. Each product of two e4m3
values is exact (at most 8 significant bits). The hardware then adds ``chunk`` products and the
running accumulator c in one fused step:

    terms  = [c, p_1, ..., p_chunk]                       # c: FP32 accumulator, p: exact products
    e_max  = largest exponent among the nonzero terms     # IEEE convention, 1 <= |significand| < 2
    unit   = 2 ** (e_max - frac_bits)                     # every term aligned to the largest one
    t_i    = round_term(terms_i / unit) * unit            # bits below ``unit`` are dropped (rz / floor)
    c'     = round_out(sum t_i, out_bits)                 # exact sum, then the result's own rounding

What "exponent" means for a product is the ``align`` parameter. "product": the product's own exponent.
"operands": the sum of its operands' exponents, ea + eb (e4m3 subnormals count as 2**-6), the way a
multiplier that keeps the significand product in [1, 4) would align it: the unit is then half as large
whenever the largest product's significands multiply to 2 or more. The second is the model of Microsoft's
MMA-Sim for Hopper's FP8 ``wgmma`` (13 fraction bits, truncation, output truncated to 13 bits).

It chains such steps over the instruction's K (32 for FP8) and over successive instructions that
accumulate into the same registers (the four k32 steps of one 128-wide block). ``TensorCoreModel``
names the parameters; ``SM90_FP8_TC_OPERANDS`` reproduces the H200 bit for bit on its test vectors
(``lab/numerics/tc_fit.py`` runs them and ranks ``model_grid()`` with ``fit_tensorcore_model``;
docs/kernel-numerics.md records the result), ``SM90_FP8_TC`` is the earlier, 90%-exact fit.
``EXACT_BLOCK`` is the plain model: the exact block sum rounded once to FP32.

Dimension legend: M rows of A (tokens), N rows of B (weight rows), K the reduced dimension.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import torch


@dataclass(frozen=True)
class TensorCoreModel:
    """One fused-add step of ``chunk`` products plus the accumulator (see the module docstring)."""

    name: str
    chunk: int = 32
    frac_bits: int = 60  # >= 52: no alignment loss (the exact model)
    term_round: str = "rz"  # "rz": toward zero; "floor": toward -inf (two's-complement truncation)
    out_bits: int = 23  # mantissa bits the accumulator keeps after each step
    out_round: str = "rn"  # "rn" or "rz"
    align: str = "product"  # which exponent of a product sets e_max: "product" or "operands" (ea + eb)

    def __post_init__(self) -> None:
        if self.chunk <= 0 or 32 % self.chunk:
            raise ValueError(f"chunk must divide 32 (the FP8 wgmma K), got {self.chunk}")
        if self.term_round not in ("rz", "floor"):
            raise ValueError(f"term_round must be 'rz' or 'floor', got {self.term_round!r}")
        if self.out_round not in ("rn", "rz"):
            raise ValueError(f"out_round must be 'rn' or 'rz', got {self.out_round!r}")
        if self.align not in ("product", "operands"):
            raise ValueError(f"align must be 'product' or 'operands', got {self.align!r}")
        if not 1 <= self.out_bits <= 23:
            raise ValueError(f"out_bits must be in [1, 23], got {self.out_bits}")

    @property
    def is_exact(self) -> bool:
        return self.frac_bits >= 52 and self.out_bits == 23 and self.out_round == "rn"


EXACT_BLOCK = TensorCoreModel("exact-block")
# The first fit on the H200's test vectors (2026-12-02): the result keeps 13 mantissa bits (every observed
# output has its low 10 bits zero); aligned to the largest product it reproduces 90% of single-k32 outputs
# bit for bit (the exact FP32 sum: 51%). Kept to compare with.
SM90_FP8_TC = TensorCoreModel("sm90-fp8-tc", chunk=32, frac_bits=13, term_round="rz", out_bits=13, out_round="rz")
# The same with the alignment of Microsoft's MMA-Sim for Hopper FP8 wgmma: e_max from the operands'
# exponents (ea + eb), so a largest product with significands multiplying to >= 2 keeps one more bit.
# 100% of the H200's test outputs at K = 32, 64 and 128 (2026-12-03, lab/numerics/tc_fit.py): the default.
SM90_FP8_TC_OPERANDS = TensorCoreModel(
    "sm90-fp8-tc-operands", chunk=32, frac_bits=13, term_round="rz", out_bits=13, out_round="rz", align="operands"
)


# Recipe.mma name -> model (recipe.MMA_MODELS lists the same names). Experiments may rebind an entry.
MODELS: dict[str, TensorCoreModel] = {m.name: m for m in (EXACT_BLOCK, SM90_FP8_TC, SM90_FP8_TC_OPERANDS)}


def _round_mantissa(s: torch.Tensor, bits: int, mode: str) -> torch.Tensor:
    """Round float64 s to ``bits`` fraction bits (FP32-like, no subnormal handling below 2**-126)."""
    if bits >= 52:
        return s
    m, e = torch.frexp(s)  # s = m * 2**e, |m| in [0.5, 1)
    scaled = torch.ldexp(m, torch.full_like(e, bits + 1))
    scaled = torch.trunc(scaled) if mode == "rz" else torch.round(scaled)  # torch.round: half to even
    return torch.ldexp(scaled, e - (bits + 1))


def operand_exponents(x: torch.Tensor) -> torch.Tensor:
    """e4m3 values (any float dtype) -> int32 exponent, 1 <= |significand| < 2; subnormals and zero: -6."""
    _, e = torch.frexp(x.float())
    e = torch.where(x != 0, e - 1, torch.full_like(e, -6))  # frexp(0) has exponent 0
    return e.clamp(min=-6).to(torch.int32)


def tc_step(c: torch.Tensor, p: torch.Tensor, model: TensorCoreModel, e_ops: torch.Tensor | None = None) -> torch.Tensor:
    """One fused step: c float64 [...] (FP32 values), p float64 [..., chunk] exact products -> c' float64.

    e_ops int [..., chunk]: ea + eb of each product (``operand_exponents``), needed when the model aligns
    by operands; zero products never set e_max."""
    terms = torch.cat([c.unsqueeze(-1), p], dim=-1)
    if model.frac_bits < 52:
        _, e = torch.frexp(terms)
        e = e - 1  # IEEE convention: 1 <= |significand| < 2
        if model.align == "operands":
            if e_ops is None:
                raise ValueError(f"model {model.name} aligns by operand exponents: pass e_ops")
            e = torch.cat([e[..., :1], e_ops.to(e.dtype)], dim=-1)
        e = torch.where(terms != 0, e, torch.full_like(e, -10_000))
        e_max = e.amax(dim=-1, keepdim=True).clamp(min=-1000)
        shift = model.frac_bits - e_max  # terms * 2**shift puts the unit at 1
        q = torch.ldexp(terms, shift.expand_as(terms))
        q = torch.trunc(q) if model.term_round == "rz" else torch.floor(q)
        s = torch.ldexp(q.sum(dim=-1), -shift.squeeze(-1))
    else:
        s = terms.sum(dim=-1)
    if model.out_bits == 23 and model.out_round == "rn":
        return s.float().double()
    return _round_mantissa(s, model.out_bits, model.out_round).float().double()


def tc_dot(a: torch.Tensor, b: torch.Tensor, model: TensorCoreModel, c: torch.Tensor | None = None) -> torch.Tensor:
    """a [..., M, K], b [..., N, K] (e4m3 values as floats; leading dims batch independent problems),
    K a multiple of model.chunk -> FP32 [..., M, N]: the chained tensor-core sum of one block, starting
    from accumulator c (FP32 [..., M, N], or 0)."""
    *lead, m, k = a.shape
    n = b.shape[-2]
    if b.shape[-1] != k or tuple(b.shape[:-2]) != tuple(lead):
        raise ValueError(f"a is {tuple(a.shape)} but b is {tuple(b.shape)} (want [..., N, {k}])")
    if k % model.chunk:
        raise ValueError(f"K={k} must be a multiple of the model's chunk {model.chunk}")
    if model.is_exact and c is None:
        return (a.double() @ b.double().transpose(-1, -2)).float()
    acc = torch.zeros(*lead, m, n, dtype=torch.float64, device=a.device) if c is None else c.double()
    ad, bd = a.double(), b.double()
    by_operands = model.align == "operands" and model.frac_bits < 52
    if by_operands:  # int16: ea + eb of e4m3 values lies in [-12, 16]
        ea, eb = operand_exponents(a).to(torch.int16), operand_exponents(b).to(torch.int16)
    for k0 in range(0, k, model.chunk):
        ks = slice(k0, k0 + model.chunk)
        p = ad[..., :, None, ks] * bd[..., None, :, ks]  # [..., M, N, chunk]
        e_ops = ea[..., :, None, ks] + eb[..., None, :, ks] if by_operands else None
        acc = tc_step(acc, p, model, e_ops)
    return acc.float()


# ------------------------------------------------------------------------------------ fitting
def model_grid() -> list[TensorCoreModel]:
    """The candidate models the H200 probe is fitted against."""
    out = [EXACT_BLOCK]
    for chunk, frac, tr, ob, orr, al in product(
        (4, 8, 16, 32), range(10, 27), ("rz", "floor"), (13, 23), ("rz", "rn"), ("product", "operands")
    ):
        out.append(TensorCoreModel(f"c{chunk}-f{frac}-{tr}-o{ob}{orr}-{al}", chunk, frac, tr, ob, orr, al))
    return out


def fit_tensorcore_model(
    a: torch.Tensor, b: torch.Tensor, observed: torch.Tensor, models: list[TensorCoreModel] | None = None
) -> list[tuple[float, TensorCoreModel]]:
    """Rank models by the fraction of outputs they reproduce bit for bit.

    a [M, K], b [N, K] e4m3 values; observed FP32 [M, N] from the tensor cores with no promotion
    (``torch._scaled_mm(..., use_fast_accum=True)`` with unit scales). Returns [(match, model)], best first.
    """
    res = []
    for mdl in models or model_grid():
        got = tc_dot(a, b, mdl)
        res.append((float((got.view(torch.int32) == observed.float().view(torch.int32)).float().mean()), mdl))
    res.sort(key=lambda r: -r[0])
    return res
