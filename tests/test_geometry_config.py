"""Geometry from a model config: HuggingFace-style DeepSeek key names, the dict of a Geometry, errors
that name the key."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from megamoe import PRESETS, Geometry, get_geometry
from megamoe.bench.tables import load_results

# The MoE keys of a DeepSeek-V4-Flash-style config.json (the values of the dsv4-flash preset); the dense
# MLP's intermediate_size is there too and must not be read as the expert width.
DSV4_FLASH_CONFIG = {
    "model_type": "deepseek_v4", "hidden_size": 4096, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 1, "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0, "norm_topk_prob": True, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
    "num_hidden_layers": 43, "vocab_size": 129280,
}
# DeepSeek-V3's published MoE keys: no SwiGLU clamp, sigmoid scores (which the reference does not model).
DSV3_CONFIG = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "scoring_func": "sigmoid",
}


def _fields(g: Geometry) -> dict:
    return {k: v for k, v in asdict(g).items() if k != "name"}


def test_deepseek_config_gives_the_preset_geometry():
    g = Geometry.from_config(DSV4_FLASH_CONFIG)
    assert _fields(g) == _fields(PRESETS["dsv4-flash"])
    assert g.name == "deepseek_v4" and g.intermediate == 2048  # not the dense 18432
    assert Geometry.from_config(DSV4_FLASH_CONFIG, name="my-model").name == "my-model"


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_geometry_dict_round_trips(preset):
    g = PRESETS[preset]
    assert Geometry.from_config(asdict(g)) == g
    assert get_geometry(asdict(g)) == g


def test_the_geometry_a_results_file_records_reads_back():
    res = Path(__file__).resolve().parent.parent / "bench" / "results" / "2026-12-02-h200-dg-probe.json"
    cited = json.loads((res.parent / "CITED.json").read_text())["sweep"]
    meta = load_results(res.parent / cited)["meta"]
    assert Geometry.from_config(meta["geometry"]) == PRESETS[meta["geometry"]["name"]]


def test_missing_clamp_is_named_and_overrides_apply():
    with pytest.raises(ValueError, match=r"none of \['swiglu_limit', 'clamp'\] \(for clamp\) or pass clamp="):
        Geometry.from_config(DSV3_CONFIG)
    with pytest.raises(ValueError, match="score_func must be 'sqrtsoftplus' or 'softmax', got 'sigmoid'"):
        Geometry.from_config(DSV3_CONFIG, clamp=float("inf"))
    g = Geometry.from_config(DSV3_CONFIG, clamp=float("inf"), score_func="softmax")
    assert (g.hidden, g.intermediate, g.num_experts, g.num_topk, g.routed_scaling) == (7168, 2048, 256, 8, 2.5)
    with pytest.raises(TypeError, match=r"unknown override\(s\) \['experts'\]"):
        Geometry.from_config(DSV4_FLASH_CONFIG, experts=8)


def test_mixtral_style_keys_and_defaults():
    """num_local_experts is read; intermediate_size is not (it must be passed); absent keys take the
    stated defaults (no routed scaling, no shared expert, HF's norm_topk_prob False, softmax)."""
    cfg = {"hidden_size": 4096, "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
           "model_type": "mixtral"}
    with pytest.raises(ValueError, match=r"none of \['moe_intermediate_size', 'intermediate'\]"):
        Geometry.from_config(cfg, clamp=float("inf"))
    g = Geometry.from_config(cfg, clamp=float("inf"), intermediate=14336)
    assert (g.num_experts, g.num_topk, g.intermediate) == (8, 2, 14336)
    assert (g.routed_scaling, g.num_shared_experts, g.norm_topk_prob, g.score_func) == (1.0, 0, False, "softmax")


def test_text_config_is_read_for_multimodal_configs():
    g = Geometry.from_config({"model_type": "vl", "text_config": DSV4_FLASH_CONFIG})
    assert _fields(g) == _fields(PRESETS["dsv4-flash"])


@pytest.mark.parametrize("key, value, message", [
    ("hidden_size", "4096", "hidden_size must be int, got '4096'"),
    ("num_experts_per_tok", 6.5, "num_experts_per_tok must be int, got 6.5"),
    ("norm_topk_prob", 1, "norm_topk_prob must be bool, got 1"),
    ("swiglu_limit", None, "swiglu_limit must be float, got None"),
    ("hidden_size", 4000, "hidden must be a positive multiple of 128, got 4000"),
    ("num_experts_per_tok", 300, r"num_topk must be in \[1, 256\], got 300"),
])
def test_bad_values_name_the_key(key, value, message):
    with pytest.raises(ValueError, match=message):
        Geometry.from_config({**DSV4_FLASH_CONFIG, key: value})


def test_not_a_dict():
    with pytest.raises(TypeError, match="config must be a dict, got str"):
        Geometry.from_config("dsv4-flash")
