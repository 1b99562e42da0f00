"""The numerics study: tensor-core accumulation and the kernels' rounding points (lab/numerics/JOURNAL.md)."""
