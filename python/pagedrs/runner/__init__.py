"""The model runner and what it owns: step buffers, KV and swap pools, sampling state, CUDA graphs."""
