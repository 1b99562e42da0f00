"""``megamoe bench``: arguments and entry point (megamoe/cli.py wires ``add_arguments`` and ``main``).

    megamoe bench                                 # dsv4-flash, 1..8192 tokens, every backend, all studies
    megamoe bench --preset small --tokens 1 8 64 --backends reference --passes 1 --no-studies
    python -m megamoe.bench.cli ...               # the same without the top-level CLI
"""

from __future__ import annotations

import argparse
import sys

from .sweep import DEFAULT_TOKENS, SweepConfig, run_sweep


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="dsv4-flash", help="geometry preset (dsv4-flash, dsv4-pro, small, tiny)")
    p.add_argument("--tokens", type=int, nargs="+", default=DEFAULT_TOKENS, help="tokens per rank to sweep")
    p.add_argument("--backends", nargs="+", default=None,
                   help="names from megamoe.fused.registry.BACKENDS and/or 'reference' (default: all that run here)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per case (median reported)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rotate", type=int, default=4, help="input sets rotated for callable backends")
    p.add_argument("--no-flush", action="store_true", help="do not flush L2 between timed calls")
    p.add_argument("--graph", action="store_true", help="also time CUDA-graph replays of each launch")
    p.add_argument("--passes", type=int, default=2, help="timed passes per case, run back to back per case (A then B; repeatability spread per row)")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check before timing")
    p.add_argument("--max-diff", type=float, default=1e-3, help="calc_diff above this marks a row FAIL")
    p.add_argument("--reference-max-tokens", type=int, default=8192)
    p.add_argument("--reference-repeats", type=int, default=3)
    p.add_argument("--host-min-time", type=float, default=0.5,
                   help="host-bound rows (the eager reference): keep timing until this many seconds of samples")
    p.add_argument("--host-min-warmup", type=float, default=1.0, help="host-bound rows: warm up at least this long")
    p.add_argument("--host-max-repeats", type=int, default=64, help="host-bound rows: at most this many timed calls")
    p.add_argument("--no-host-filter", action="store_true",
                   help="host-bound rows: keep the batches a slow host probe stands beside (slow passes are still retaken)")
    p.add_argument("--host-extra-budget", type=float, default=SweepConfig.host_extra_budget_s,
                   help="host-bound rows: seconds the whole run may spend on retakes, their waits and set-aside calls")
    p.add_argument("--host-max-time", type=float, default=SweepConfig.host_max_time_s,
                   help="host-bound rows: time a pass at most this long to collect batches at the host's usual speed")
    p.add_argument("--device-min-warmup", type=float, default=SweepConfig.device_min_warmup_s,
                   help="device-bound rows (CUDA): warm up at least this many seconds of device time")
    p.add_argument("--device-min-time", type=float, default=SweepConfig.device_min_time_s,
                   help="device-bound rows (CUDA): keep timing until this many seconds of samples")
    p.add_argument("--device-max-repeats", type=int, default=SweepConfig.device_max_repeats, help="device-bound rows: at most this many timed calls")
    p.add_argument("--repeat-mode", choices=("interleaved", "sweeps"), default=SweepConfig.repeat_mode,
                   help="interleaved: a case's passes back to back; sweeps: whole sweeps back to back")
    p.add_argument("--settle", type=float, default=SweepConfig.settle_s, help="CUDA: idle seconds before each timed phase")
    p.add_argument("--no-pin", action="store_true",
                   help="do not pin the timing thread to one CPU (CUDA runs pin it once the builds are done)")
    p.add_argument("--no-block-m", action="store_true", help="skip the forced-BLOCK_M study")
    p.add_argument("--block-m-tokens", type=int, nargs="+", default=None)
    p.add_argument("--no-ragged", action="store_true", help="skip the ragged-step study")
    p.add_argument("--ragged-means", type=int, nargs="+", default=[16, 256, 2048])
    p.add_argument("--no-staging", action="store_true", help="skip the staging-cost study")
    p.add_argument("--no-overhead", action="store_true", help="skip the bare-loop overhead check")
    p.add_argument("--overhead-tokens", type=int, nargs="+", default=[128, 8192])
    p.add_argument("--no-studies", action="store_true", help="only ceilings + sweep")
    p.add_argument("--deadline", type=float, default=None, help="seconds after which optional studies are skipped")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results", help="results folder; a subfolder date_card_commit is made")
    p.add_argument("--no-progress", action="store_true")


def config_from_args(a: argparse.Namespace) -> SweepConfig:
    studies = not a.no_studies
    return SweepConfig(
        preset=a.preset, tokens=sorted(set(a.tokens)), backends=a.backends, repeats=a.repeats, warmup=a.warmup,
        rotate=a.rotate, flush_l2=not a.no_flush, graph=a.graph, passes=a.passes, check=not a.no_check,
        max_diff=a.max_diff, reference_max_tokens=a.reference_max_tokens, reference_repeats=a.reference_repeats,
        host_min_time_s=a.host_min_time, host_min_warmup_s=a.host_min_warmup, host_max_repeats=a.host_max_repeats,
        host_batch_filter=not a.no_host_filter, host_max_time_s=a.host_max_time,
        host_extra_budget_s=a.host_extra_budget,
        device_min_warmup_s=a.device_min_warmup, device_min_time_s=a.device_min_time,
        device_max_repeats=a.device_max_repeats, repeat_mode=a.repeat_mode, settle_s=a.settle, pin_cpu=not a.no_pin,
        block_m_study=studies and not a.no_block_m, block_m_tokens=a.block_m_tokens,
        ragged=studies and not a.no_ragged, ragged_means=a.ragged_means, staging=studies and not a.no_staging,
        overhead=studies and not a.no_overhead, overhead_tokens=a.overhead_tokens, seed=a.seed, device=a.device,
        out_dir=a.out or None, deadline_s=a.deadline, progress=not a.no_progress,
    )


def main(args: argparse.Namespace) -> int:
    from .report import print_tables

    cfg = config_from_args(args)
    results = run_sweep(cfg)
    print_tables(results)
    out = results.get("out_dir")
    if out:
        print(f"results written to {out}")
    return 1 if not results["rows"] else 0


def _standalone(argv=None) -> int:
    p = argparse.ArgumentParser(prog="megamoe bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(_standalone())
