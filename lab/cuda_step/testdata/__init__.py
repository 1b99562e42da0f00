"""Saved H200 files the cuda step's tests read: per-stage traces and timelines of runs 36 and 37 (gzip of what
``lab/cuda_step/probe.py`` saved; the raw files are in git history under
bench/results/2026-12-04_nvidia-h200_decode-tc/run36-cuda-step1/ and run37-cuda-step1/).

    saved("run36-trace-784b68b.pt")        the file's bytes
    load("run36-trace-784b68b.pt")         the tensor it holds
"""

from __future__ import annotations

import gzip
import io
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def saved(name: str) -> bytes:
    return gzip.decompress((HERE / f"{name}.gz").read_bytes())


def load(name: str) -> torch.Tensor:
    return torch.load(io.BytesIO(saved(name)))
