"""The worker: model runner and KV cache pools."""
