"""The decode study: the Triton decode launches at 1-64 tokens (lab/decode/JOURNAL.md)."""
