"""SGLang's native routes (``/generate``, ``/get_model_info``), so SGLang's clients and tutorials run."""
