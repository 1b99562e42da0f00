"""Thin backends over the real SM90 Mega MoE kernels."""
