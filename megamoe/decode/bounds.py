"""The decode path's token bound, stated once and importable without triton: the buffers' capacity, the launch
check and the backends' ``max_tokens_per_rank`` (which the bench harness reads) all read it. The routing kernel
sorts all T * K slots in one program."""

MAX_TOKENS = 64
