"""Model building blocks: attention over the paged KV cache, RoPE, norms, activations, linear layers."""
