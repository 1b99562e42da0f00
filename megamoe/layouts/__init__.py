"""Weight and activation layouts of each kernel, with exact inverses, range checks and plan models."""
