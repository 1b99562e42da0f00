"""The lab: studies, their probes and journals (lab/README.md). Not part of the megamoe package."""
