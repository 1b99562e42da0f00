"""H200 probe of DeepGEMM's SM90 ``fp8_mega_moe``: which configuration each token count runs, where the
L2 activation scales live in its buffer, and how its L2-input codes differ from the reference.

    pip install -e ".[fused]" && OUT=/tmp/dg python3 lab/numerics/dg_probe.py        (on an H200)

Per case: the C++ heuristic's printout (``DG_PRINT_CONFIGS=1``, read from file descriptor 1), the
template arguments of every kernel the JIT built for it (from the generated source in
``DG_JIT_CACHE_DIR``), calc_diff / code match against the exact-block reference, and where each
reference L2 scale value sits in the raw ``l2_acts_sf`` region (flat index; continuous FP32 scales are
nearly unique, so a value search reveals the layout). The small-geometry cases also save their tensors
(inputs, kernel output, pool, L2 codes, raw scales, FP8 weights) for the offline accumulation fit.
"""

from __future__ import annotations

import os
import tempfile

OUT = os.environ.get("OUT", "/tmp/dg_probe_out")
os.makedirs(OUT, exist_ok=True)
CACHE = tempfile.mkdtemp(prefix="dgcache-")
os.environ["DG_JIT_CACHE_DIR"] = CACHE
os.environ["DG_PRINT_CONFIGS"] = "1"

import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))  # the repository root: megamoe and lab
from lab.common.probe_journal import ProbeJournal  # noqa: E402

T0 = time.time()
RESULT: dict = {"cases": [], "errors": [], "cache": CACHE}


JOURNAL = ProbeJournal(OUT, "dg_probe.json", RESULT, t0=T0)
log, dump = JOURNAL.log, JOURNAL.dump


def captured(fn):
    """Run fn() and wait for the GPU with file descriptor 1 redirected; returns (result, text on fd 1)."""
    from megamoe.fused.deepgemm_fp8 import capture_stdout_fd

    def run():
        res = fn()
        torch.cuda.synchronize()
        return res

    return capture_stdout_fd(run)


def cache_sources() -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(CACHE):
        for f in files:
            if f.endswith((".cu", ".cuh", ".cpp")):
                p = os.path.join(root, f)
                out[p] = open(p, errors="replace").read()
    return out


def template_args(src: str) -> str:
    from megamoe.fused.deepgemm_fp8 import template_instantiation

    inst = template_instantiation(src)
    return " ".join(inst.split()) if inst else ""


def locate_scales(raw: torch.Tensor, rows: torch.Tensor, ref_sf: torch.Tensor, n: int = 3000) -> list:
    """raw fp32 flat; rows [R] kernel pool rows; ref_sf [R, G] -> [(row, g, flat index or -1, count)]."""
    flat = raw.reshape(-1)
    vals, order = torch.sort(flat)
    r, gn = ref_sf.shape
    sel = torch.randperm(r * gn, generator=torch.Generator().manual_seed(0))[:n].to(raw.device)
    rr, gg = sel // gn, sel % gn
    v = ref_sf[rr, gg].contiguous()
    lo = torch.searchsorted(vals, v)
    hi = torch.searchsorted(vals, v, right=True)
    found = hi > lo
    idx = torch.where(found, order[lo.clamp(max=vals.numel() - 1)], torch.full_like(lo, -1))
    return [[int(a), int(b), int(c), int(d)] for a, b, c, d in
            zip(rows[rr].tolist(), gg.tolist(), idx.tolist(), (hi - lo).tolist())]


def run_case(be, g, w_fp8, geo: str, t: int, save: bool):
    from megamoe.fused.compare import compare_l2_inputs, match_pool_tokens
    from megamoe.layouts.staging import per_token_cast_to_fp8
    from megamoe.reference import moe_forward
    from megamoe.inputs import make_inputs
    from megamoe.testing import calc_diff

    dev = torch.device("cuda")
    row = {"geometry": geo, "tokens": t}
    inp = make_inputs(g, t, seed=1000 + t).to(dev)
    before = set(cache_sources())
    be.poison_intermediates()
    be.stage(inp, t)
    y, text = captured(lambda: be.launch(t).clone())
    srcs = cache_sources()
    row["config_print"] = text.strip()[-3000:]
    row["new_kernels"] = [template_args(s) for p, s in srcs.items() if p not in before and template_args(s)]
    _, text2 = captured(lambda: be.launch(t).clone())
    row["second_launch_print_chars"] = len(text2.strip())
    y2 = be.launch(t).clone()
    torch.cuda.synchronize()
    row["deterministic"] = bool(torch.equal(y.view(torch.int16), y2.view(torch.int16)))
    be.poison_intermediates()
    be.stage(inp, t)
    y = be.launch(t).clone()
    torch.cuda.synchronize()
    inter = be.intermediates()
    res = moe_forward(inp, be.kernel_weights, be.recipe, g, keep_stages=True)
    row["calc_diff"] = calc_diff(y, res.y[0])
    st = res.ranks[0]
    cmp = compare_l2_inputs(inter, st, inp, g.num_topk)
    row.update(cmp)
    row["l2_acts_sf_shape"] = list(inter["l2_in_sf_raw"].shape)
    row["l2_acts_shape"] = list(inter["l2_in"].shape)
    row["l1_acts_shape"] = list(inter["pool_x"].shape)
    # Where do the reference scales of matched rows sit in the raw region?
    x_q, _ = per_token_cast_to_fp8(inp.x)
    tok = match_pool_tokens(inter["pool_x"], x_q)
    krows = torch.nonzero(tok >= 0).squeeze(1)
    if krows.numel():
        # the reference row of each kernel row: best code agreement among the token's slots
        lay = st.layout
        table = torch.full((t, g.num_topk), -1, dtype=torch.int64, device=dev)
        real = torch.nonzero(lay.src_token.to(dev) >= 0).squeeze(1)
        table[lay.src_token.to(dev)[real], lay.src_slot.to(dev)[real]] = real
        kc = inter["l2_in"].view(torch.uint8)[krows].unsqueeze(1)
        cand = table[tok[krows]]
        rc = st.l2_in.to(dev).view(torch.uint8)[cand.clamp(min=0)]
        agree = (kc == rc).float().mean(2).masked_fill(cand < 0, -1)
        best = cand.gather(1, agree.argmax(1, keepdim=True)).squeeze(1)
        ref_sf = st.l2_in_sf.to(dev)[best]
        row["scale_locations"] = locate_scales(inter["l2_in_sf_raw"].float(), krows, ref_sf)
        # code differences: how often the kernel's |code| is above / below the reference's
        kv = inter["l2_in"][krows].float()
        rv = st.l2_in.to(dev)[best].float()
        diff = kv != rv
        row["codes_differ"] = float(diff.float().mean())
        row["codes_kernel_larger_mag"] = float(((kv.abs() > rv.abs()) & diff).float().mean())
        row["codes_kernel_smaller_mag"] = float(((kv.abs() < rv.abs()) & diff).float().mean())
        row["codes_sign_flip"] = float(((kv * rv) < 0).float().mean())
        if save:
            torch.save({
                "x": inp.x.cpu(), "topk_idx": inp.topk_idx.cpu(), "topk_weights": inp.topk_weights.cpu(),
                "y": y.cpu(), "pool_x": inter["pool_x"].cpu(), "l2_in": inter["l2_in"].cpu(),
                "l2_sf_raw": inter["l2_in_sf_raw"].cpu(), "krows": krows.cpu(), "tok": tok.cpu(),
            }, os.path.join(OUT, f"dg_{geo}_T{t}.pt"))
    return row


def main():
    from megamoe.fused.deepgemm_fp8 import DeepGEMMFP8
    from megamoe.geometry import get_geometry
    from megamoe.weights import random_mxfp4_weights
    from megamoe.layouts.deepgemm_sm90 import to_fp8_block

    dev = torch.device("cuda")
    plan = [("small", 512, (1, 7, 64, 300, 512)), ("dsv4-flash", 8192, (1, 128, 2048, 8192))]
    for geo, cap, tokens in plan:
        g = get_geometry(geo)  # the matrix's random weights: the small preset's drawn on the CPU, as there
        w = random_mxfp4_weights(g, seed=0, device=dev) if geo != "small" else random_mxfp4_weights(g, seed=0).to(dev)
        w8 = to_fp8_block(w)
        be = DeepGEMMFP8(g, capacity=cap)
        be.prepare(w8)
        be.allocate()
        if geo == "small":
            kw = be.kernel_weights
            torch.save({k: v.cpu() for k, v in kw.__dict__.items() if isinstance(v, torch.Tensor)},
                       os.path.join(OUT, "dg_small_weights.pt"))
        for t in tokens:
            if time.time() - T0 > float(os.environ.get("PROBE_DEADLINE_S", "300")):
                RESULT["errors"].append({"case": f"{geo}-T{t}", "error": "deadline"})
                continue
            try:
                r = run_case(be, g, w8, geo, t, save=(geo == "small" and t in (7, 64, 300, 512)))
                RESULT["cases"].append(r)
                log(geo, t, f"diff {r['calc_diff']:.2e} codes {r.get('code_match', float('nan')):.4f}",
                    r["new_kernels"][:1], r["config_print"][:300])
            except Exception as exc:  # noqa: BLE001
                RESULT["errors"].append({"case": f"{geo}-T{t}", "error": repr(exc), "tb": traceback.format_exc()[-3000:]})
                log("FAILED", geo, t, exc)
            dump()
        be.destroy()
    dump()


if __name__ == "__main__":
    main()
