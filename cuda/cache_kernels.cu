// reshape_and_cache, copy_blocks (placeholder until the kernels land)
