"""The Humming glue kernels against their torch twins; run by tests/test_humming.py with TRITON_INTERPRET=1.
Prints one JSON list of {case, ok, ...} as its last line."""

from __future__ import annotations

import json

import torch

from megamoe.fused import humming_glue as hg


def align_case(m: int, block: int, seed: int) -> dict:
    e, k = 16, 4
    gen = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(m)]).long()
    idx[torch.rand(m, k, generator=gen) < 0.3] = -1
    if m > 1:
        idx[idx == 5] = -1  # an expert with no slot
    ref_ids, ref_experts, total = hg.align_block_size_torch(idx, e, block)
    bound = hg.padded_slots_bound(m, k, e, block)
    sorted_ids = torch.full((bound,), -7, dtype=torch.int32)
    expert_ids = torch.full((bound // block + 1,), -7, dtype=torch.int32)
    num = torch.full((1,), -7, dtype=torch.int32)
    counts, cursor = torch.zeros(e, dtype=torch.int32), torch.zeros(e, dtype=torch.int32)
    ok = True
    for _ in range(2):  # twice: the first launch must leave the counts ready for the second
        hg.align_block_size(idx, e, block, sorted_ids=sorted_ids, expert_ids=expert_ids, num_padded=num,
                            counts=counts, cursor=cursor)
        ok &= int(num) == total and torch.equal(expert_ids[: total // block], ref_experts) and bool((counts == 0).all())
        ok &= torch.equal(sorted_ids[:total], ref_ids)  # ascending slots per expert, then the padding
    return {"case": f"align m={m} block={block}", "ok": bool(ok), "padded": total}


def swiglu_case() -> dict:
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(13, 512, generator=gen) * 6).to(torch.bfloat16)  # past the clamp both ways
    out = torch.full((13, 256), float("nan"), dtype=torch.bfloat16)
    hg.swiglu_into(gate_up, out, 10.0)
    want = hg.swiglu_torch(gate_up, 10.0)
    return {"case": "swiglu", "ok": torch.equal(out.view(torch.int16), want.view(torch.int16)),
            "differing": int((out.view(torch.int16) != want.view(torch.int16)).sum())}


def combine_case() -> dict:
    gen = torch.Generator().manual_seed(1)
    m, k, h = 5, 4, 512
    slots = (torch.randn(m, k, h, generator=gen) * 3).to(torch.bfloat16)
    w = torch.rand(m, k, generator=gen)
    idx = torch.randint(0, 16, (m, k), generator=gen)
    idx[1, 2], idx[3] = -1, -1
    slots[1, 2] = float("nan")  # a masked slot's row is never written by the GEMM: it must not be read
    y = torch.full((m, h), float("nan"), dtype=torch.bfloat16)
    hg.combine_into(slots, w, idx, y)
    # The interpreter evaluates tl.fma as x * y + z with two FP32 roundings (triton's interpreter.create_fma), so
    # here the order, the masking and the bf16 rounding are checked against that arithmetic; the FMA's single
    # rounding is the GPU's (combine_torch, checked on the H200 by the matrix's bits).
    acc = torch.zeros(m, h)
    for s in range(k):
        acc = torch.where(idx[:, s:s + 1] >= 0, acc + slots[:, s].float() * w[:, s:s + 1], acc)
    want = acc.to(torch.bfloat16)
    return {"case": "combine", "ok": torch.equal(y.view(torch.int16), want.view(torch.int16)) and bool((y[3] == 0).all()),
            "differing_from_true_fma": int((y.view(torch.int16) != hg.combine_torch(slots, w, idx).view(torch.int16)).sum())}


if __name__ == "__main__":
    cases = [align_case(m, b, s) for m, b, s in ((1, 8, 0), (7, 16, 1), (40, 8, 2), (64, 64, 3))]
    print(json.dumps(cases + [swiglu_case(), combine_case()]))
