"""The DeepGEMM SM90 FP4 kernel's configurations as an H200 recorded them, read back from a results folder.

    recorded_fp4_configs(folder)  -> [RecordedConfig]   every launch configuration the folder holds
    parse_plan_summary(text)      -> {field: value}     ``Plan.describe()`` text -> the fields it names

A results folder of ``bench/device/deepgemm_fp4.sh`` (e.g. ``bench/results/2026-12-03_nvidia-h200_deepgemm-fp4``)
records configurations in two forms:

- **full**: ``plan_record`` rows (``probe-*.json`` sections ``plans`` and ``race``): every
  ``MegaMoESM90Config`` field and the printed key's flags (``DG_PRINT_CONFIGS``, that launch's own
  printout), plus the decode options read from the JIT source of a cached kernel (``JIT_SOURCE_FLAGS``);
- **summary**: ``Plan.describe()`` text (``matrix.json``, the probes' other sections, the ``PREBUILD`` lines
  of ``build-log.txt``): BLOCK_M, BLOCK_N, experts per wave, stages, swap-AB.

The JIT-source flags are not a launch's own printout: the backend finds the cached kernel whose template
arguments match the printed configuration, and kernels that differ only in these flags (DeepSeek-V4-Flash
T = 8 and T = 16, for one) match alike. Results recorded before the backend checked that (the 2026-12-03
H200 run) took the first match, so one kernel's flags were read for both; ``kernel_family`` names the
fields that match compared, and records of one family and capacity may carry a sibling's flags. Later
records leave such flags out and list them in ``ambiguous_template_args``.

A record names the launch's geometry, the capacity the backend was built for (DeepGEMM rounds it up:
``megamoe.layouts.deepgemm_configs.buffer_tokens_per_rank``), the launch token count and the
``DG_SM90_FP4_SWAP_AB`` switch. Launches whose printout was not seen (the package prints a configuration
once per process) have no configuration and are skipped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

# Decode options the plan takes from the JIT source (not from the launch's printout).
JIT_SOURCE_FLAGS = ("wide_load_decode", "math_wg_participates_in_decode", "num_math_wg_decode_warps",
                    "first_decode_assist_warp", "l2_arrival_counter", "ss_nsplit")
# What ``find_kernel_args`` compares to pick the cached kernel (plus the capacity).
KERNEL_FAMILY_FIELDS = ("block_m", "block_n", "block_k", "num_max_pool_tokens", "num_padded_sf_pool_tokens",
                        "num_stages", "num_experts_per_wave", "num_dispatch_threads", "num_non_epilogue_threads",
                        "num_epilogue_threads")
_NOT_CONFIG = {"tokens", "tokens_per_expert", "launches", "differing_from_first", "max_rows_differing", "source",
               "decode_loss", "ambiguous_template_args"}
_SUMMARY = re.compile(r"BLOCK_M (\d+); block_n=(\d+), num_experts_per_wave=(\d+), num_stages=(\d+), swap_ab=(True|False)")


@dataclass(frozen=True)
class RecordedConfig:
    """One launch configuration the kernel reported. ``fields``: recorded field -> value."""

    source: str  # file: section or case
    geometry: str  # megamoe preset name
    capacity: int  # tokens per rank the backend was built for (before DeepGEMM's alignment)
    tokens: int  # the launch's token count
    swap_ab_enabled: bool  # the DG_SM90_FP4_SWAP_AB switch of the launch
    fields: dict
    full: bool  # all fields (plan_record) or the summary text's five

    def kernel_family(self) -> tuple:
        """(geometry, capacity, the fields the cached-kernel match compares); full records only."""
        return (self.geometry, self.capacity) + tuple(self.fields[k] for k in KERNEL_FAMILY_FIELDS)


def parse_plan_summary(text: str) -> dict | None:
    """'BLOCK_M 64; block_n=128, num_experts_per_wave=16, num_stages=5, swap_ab=True, ...' -> the five fields;
    None for a plan without a configuration ('BLOCK_M 0; ... not yet built', 'no launch (0 tokens)')."""
    m = _SUMMARY.match(text)
    if not m:
        return None
    return {"block_m": int(m[1]), "block_n": int(m[2]), "num_experts_per_wave": int(m[3]), "num_stages": int(m[4]),
            "swap_ab": m[5] == "True"}


def _full(source, geometry, capacity, row) -> RecordedConfig | None:
    if not row.get("block_m"):
        return None
    fields = {k: v for k, v in row.items() if k not in _NOT_CONFIG}
    return RecordedConfig(source, geometry, capacity, int(row["tokens"]), True, fields, True)


def _summary(source, geometry, capacity, tokens, text, swap_ab_enabled=True) -> RecordedConfig | None:
    fields = parse_plan_summary(text)
    if fields is None:
        return None
    return RecordedConfig(source, geometry, int(capacity), int(tokens), swap_ab_enabled, fields, False)


def _matrix(folder: Path) -> list:
    """matrix.json: one backend per (geometry, weights), built for the largest launch of its cases."""
    rows = json.loads((folder / "matrix.json").read_text())["rows"]
    launch = {r["case"]: max(r["ragged"]) if r.get("ragged") else r["num_tokens"] for r in rows}
    cap: dict = {}
    for r in rows:
        key = (r["geometry"], r["weights"])
        cap[key] = max(cap.get(key, 1), launch[r["case"]])
    return [_summary(f"matrix.json: {r['case']}", r["geometry"], cap[r["geometry"], r["weights"]], launch[r["case"]],
                     r["plan"]) for r in rows]


def _probes(folder: Path) -> list:
    out = []
    flash = "dsv4-flash"
    for name in ("probe-plans-lossy.json", "probe-lut-checkpoint.json"):
        d = json.loads((folder / name).read_text())
        out += [_full(f"{name}: plans", flash, 8192, r) for r in (d.get("plans") or {}).get("plans", [])]
        for r in (d.get("checkpoint") or [])[1:] + (d.get("lossy") or [])[1:]:
            out.append(_summary(f"{name}: {r['case']}", flash, r["capacity"], r["launch_tokens"], r["plan"]))
        if d.get("lut"):  # the crafted decode-probe layer: small preset, capacity 8, 8 tokens
            out.append(_summary(f"{name}: lut", "small", 8, 8, d["lut"]["plan"]))
    race = json.loads((folder / "probe-race.json").read_text())
    out += [_full("probe-race.json: race", flash, 8192, r) for r in race.get("race") or []]
    d = json.loads((folder / "probe-determinism-variants.json").read_text())
    for r in d.get("determinism") or []:
        out.append(_summary(f"probe-determinism-variants.json: determinism cap {r['capacity']} T{r['tokens']} "
                            f"swap-AB switch {r['swap_ab_env']}", flash, r["capacity"], r["tokens"], r["plan"],
                            r["swap_ab_env"] != "0"))
    for r in d.get("variants") or []:  # the probe builds small at capacity 512, dsv4-flash at 8192
        m = re.match(r"(small|dsv4-flash)-T(\d+)", r["case"])
        cap = r.get("capacity", 512 if m[1] == "small" else 8192)  # subset rows do not repeat it
        out.append(_summary(f"probe-determinism-variants.json: {r['case']}", m[1], cap, int(m[2]), r["plan"]))
    return out


def _prebuild(folder: Path) -> list:
    out = []
    for line in (folder / "build-log.txt").read_text().splitlines():
        if line.startswith("PREBUILD "):
            d = json.loads(line[len("PREBUILD "):])
            out += [_summary(f"build-log.txt: prebuild {d['preset']} capacity {d['capacity']}", d["preset"],
                             d["capacity"], int(t), text) for t, text in d["plans"].items()]
    return out


def recorded_fp4_configs(folder) -> list[RecordedConfig]:
    """Every configuration a DeepGEMM SM90 FP4 results folder records (full records first)."""
    folder = Path(folder)
    recs = [r for r in _probes(folder) + _matrix(folder) + _prebuild(folder) if r is not None]
    return sorted(recs, key=lambda r: not r.full)


def prebuild_cubins(folder) -> int:
    """How many kernels the prebuild step left in the JIT cache ('... N cubins' in build-log.txt)."""
    m = re.search(r"prebuild: .* (\d+) cubins", (Path(folder) / "build-log.txt").read_text())
    if not m:
        raise ValueError(f"{folder}/build-log.txt has no 'prebuild: ... N cubins' line")
    return int(m[1])
