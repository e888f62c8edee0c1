"""Models: the model cards, the registry of served names and LoRA adapters (the serving class), the routes."""
