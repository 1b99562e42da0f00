"""The 1-token CUDA step study (lab/cuda_step/JOURNAL.md)."""
