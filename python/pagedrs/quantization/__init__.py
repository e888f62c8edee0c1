"""Quantized weight formats, as vLLM keeps `model_executor/layers/quantization/`: what a checkpoint
declares (`config`), GGUF's block types (`gguf_blocks`), the GPTQ / AWQ / FP8 arithmetic (`dequant`), the
parts kept packed for the GPU (`packed_parts`), and a quantized checkpoint's tensors turned into layer
weights (`checkpoint`). Both the loader and the layers import them."""
