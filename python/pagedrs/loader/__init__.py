"""Model loading: a local HF folder (config.json + safetensors or PyTorch .bin, sharded or not, tokenizer
files), a GGUF file (converted once into a cache folder), a Hugging Face Hub name (`hub`), or None for the
default model. Where a model is (`paths`), its dtype (`dtype`), its weights (`checkpoint`, `gguf`,
`safetensors`, `pytorch_bin`), its tokenizer (`tokenizer`) and the load itself (`load`). The names below
are handed on as they are (`X as X`: a re-export)."""

from pagedrs.loader.checkpoint import iter_checkpoint as iter_checkpoint
from pagedrs.loader.dtype import resolve_dtype as resolve_dtype
from pagedrs.loader.gguf import cache_root as cache_root
from pagedrs.loader.load import LoadedModel as LoadedModel
from pagedrs.loader.load import keeps_quantized as keeps_quantized
from pagedrs.loader.load import load_hf_config as load_hf_config
from pagedrs.loader.load import load_model as load_model
from pagedrs.loader.options import LoadOptions as LoadOptions
from pagedrs.loader.paths import gguf_file as gguf_file
from pagedrs.loader.paths import model_folder as model_folder
from pagedrs.loader.paths import resolve_model_path as resolve_model_path
from pagedrs.loader.paths import resolve_paths as resolve_paths
from pagedrs.loader.tokenizer import load_tokenizer as load_tokenizer
