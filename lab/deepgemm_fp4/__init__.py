"""The DeepGEMM FP4 study: pull request #323, its race and megamoe's fences (lab/deepgemm_fp4/JOURNAL.md)."""
