"""Humming's indexed-MoE tuning lists for a geometry, computed on a machine without a GPU, and where vLLM's call
would hand the down GEMM a config of another block M than the slots' alignment.

    python3 lab/humming/tuning_lists.py [--batch-invariant] [--print-lists]

``humming.tune.get_heuristics_config`` only reads a description of the card (SM version, SM count, cache sizes),
so this describes an H100 80GB HBM3 to it in place of the CUDA query (``FakeH100``) and needs humming-kernels
0.1.20 and ``cuda-bindings`` importable (no driver). What it prints for DeepSeek-V4-Flash matched what the GPU's
own lists chose at every count of the H100 sweep (the plans in bench/results/2026-12-05_nvidia-h100_22bb55d624/),
and its small-geometry mismatches are the counts where the H100 matrix failed (JOURNAL.md, run 3). An H200 has the
same SM count and version; whether Humming tunes it differently is a question for the GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import types

import torch

GEOMETRIES = {"small": (16, 512, 256, 4), "dsv4-flash": (256, 4096, 2048, 6)}  # E, H, I, K
W4A8 = {"dtype": "float8e4m3", "input_scale_group_size": 128}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 512, 1024, 2048, 4096, 8192)


class FakeH100:
    name = "NVIDIA H100 80GB HBM3"
    is_ppu = False
    index = 0
    sm_count, sm_major, sm_minor, sm_version = 132, 9, 0, 90
    max_threads_per_block, max_threads_per_sm, max_registers_per_sm = 1024, 2048, 65536
    l2_cache_size, l2_cache_size_mb = 50 * 1024 * 1024, 50.0
    l1_cache_size, l1_cache_size_kb = 256 * 1024, 256.0


def describe_card_as_h100(set_attr=setattr) -> None:
    """Humming's card query answers FakeH100, and torch's CUDA device calls become no-ops (a test passes
    ``monkeypatch.setattr`` so that all three are undone after it)."""
    import humming.device as hd

    set_attr(hd, "_get_device_info_extension", lambda: types.SimpleNamespace(_DeviceInfo=lambda index: FakeH100()))
    set_attr(torch.cuda, "current_device", lambda: 0)
    set_attr(torch.cuda, "device", lambda index: contextlib.nullcontext())


def lists(e: int, h: int, i: int, input_config: dict | None, batch_invariant: bool):
    from humming import transform
    from humming.schema import HummingInputSchema, Mxfp4WeightSchema
    from humming.tune import get_heuristics_config

    dev = torch.device("cuda", 0)
    in_schema = HummingInputSchema.from_config(input_config) if input_config else HummingInputSchema()
    ws = Mxfp4WeightSchema().to_humming_schema(torch.bfloat16)
    out = []
    for n, k in ((2 * i, h), (h, i)):  # gate/up, down: the layer configs vLLM prepares (megamoe.fused.humming)
        cfg = transform.prepare_layer_config(shape_n=n, shape_k=k, weight_schema=ws, input_schema=in_schema,
                                             num_experts=e, pad_n_to_multiple=256, pad_k_to_multiple=128,
                                             torch_dtype=torch.bfloat16, device=dev)
        out.append(get_heuristics_config(cfg, gemm_type="indexed", device=dev, use_batch_invariant=batch_invariant))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--print-lists", action="store_true")
    a = ap.parse_args()
    describe_card_as_h100()
    from megamoe.fused.humming import pick_configs

    for geo, (e, h, i, k) in GEOMETRIES.items():
        for mode, input_config in (("w4a8", W4A8), ("w4a16", None)):
            gate_up, down = lists(e, h, i, input_config, a.batch_invariant)
            stream_k = [sum(bool(c.get("use_stream_k")) for _, _, c in lst) for lst in (gate_up, down)]
            print(f"{geo} {mode}: {len(gate_up)} / {len(down)} configs, {stream_k[0]} / {stream_k[1]} stream-K")
            for t in TOKENS:
                bm, c13, c2, note = pick_configs(gate_up, down, t * k)
                if note or a.print_lists:
                    print(f"  {t:5d} tokens: block M {bm}, stream-K {c13.get('use_stream_k')}; {note or 'lists agree'}")


if __name__ == "__main__":
    main()
