"""The staging study: FP8 staging and forced BLOCK_M (lab/staging/JOURNAL.md)."""
