"""Tools the studies share (see lab/common/JOURNAL.md)."""
