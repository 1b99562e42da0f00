"""Expert parallelism over real torch.distributed ranks (gloo on CPU, NCCL on GPU).

    spawn, init_from_env, guarded          launch.py     ranks on 127.0.0.1, failures without hangs
    moe_forward_dist, SCHEMES              reference.py  the eager reference, one process per EP rank
    agree_on_step, check_same_setup, ...   agreement.py  the data-parallel agreement rule, same-setup check
    FusedEPLauncher, EPBackend, ...        fused.py      the fused kernels over an EP group (GPU)
    check_ranks, check_fused_ranks, ...    check.py      what ``megamoe check/bench --ranks N`` call; the GPU check
"""

from .agreement import RankInputError, SetupMismatchError, StepAgreement, agree_on_step, check_same_setup, setup_fingerprint
from .check import DistBenchReport, DistCheckReport, bench_ranks, check_fused_ranks, check_ranks
from .fused import EPBackend, FusedEPLauncher, ReferenceEPBackend, check_ep_ranks, check_hopper
from .launch import LaunchTimeout, RankError, guarded, init_from_env, spawn
from .reference import SCHEMES, moe_forward_dist

__all__ = [
    "RankInputError", "SetupMismatchError", "StepAgreement", "agree_on_step", "check_same_setup", "setup_fingerprint",
    "DistBenchReport", "DistCheckReport", "bench_ranks", "check_ranks", "LaunchTimeout", "RankError", "guarded",
    "init_from_env", "spawn", "SCHEMES", "moe_forward_dist", "EPBackend", "FusedEPLauncher", "ReferenceEPBackend",
    "check_ep_ranks", "check_fused_ranks", "check_hopper",
]
