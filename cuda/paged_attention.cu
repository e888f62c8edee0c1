// paged attention decode + varlen prefill (placeholder until the kernels land)
