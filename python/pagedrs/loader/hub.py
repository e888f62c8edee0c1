"""Models by name: a Hugging Face Hub repo ("org/name", a bare "gpt2", "org/name:Q4_K_M" for one GGUF file)
fetched with `huggingface_hub` into its cache (or `download_dir`), the way vLLM downloads on first use.

Only the files the loader reads are fetched: config, tokenizer and generation config files, and one weight
format (safetensors preferred over PyTorch .bin, never both; one .gguf file of a GGUF repo). `HF_ENDPOINT`
(a mirror), `HF_TOKEN` and `HF_HUB_OFFLINE` (the cache only) work as in `huggingface_hub`. A Hub that cannot
be reached falls back to the cached copy with a warning. Every failure is a `HubError` naming the repo.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

__all__ = ["HubError", "fetch", "is_hub_name", "select_files", "split_quant"]

logger = logging.getLogger("pagedrs.loader")

# The files besides the weights that config, tokenizer and generation-config loading read.
_META_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "tokenizer.model",
        "spiece.model",
        "chat_template.jinja",
        "chat_template.json",
    }
)
_ST_INDEX = "model.safetensors.index.json"
_BIN_INDEX = "pytorch_model.bin.index.json"
_NAME_RE = re.compile(r"[\w.-]+(/[\w.-]+)?(:[\w.-]+)?")


class HubError(ValueError):
    """A model name the Hub (or the cache, offline) cannot give: the message names the repo."""

    def __init__(self, repo_id: str, message: str) -> None:
        super().__init__(message)
        self.repo_id = repo_id


def is_hub_name(model: str) -> bool:
    """Whether `model` reads as a Hub repo id ("org/name", "name", optionally ":QUANT") rather than a path."""
    if model.startswith((".", "~", "/")) or model.lower().endswith(".gguf"):
        return False
    return _NAME_RE.fullmatch(model) is not None and "--" not in model and ".." not in model


def split_quant(model: str) -> tuple[str, str | None]:
    """("org/name", "Q4_K_M") for "org/name:Q4_K_M"; (model, None) without a ":"."""
    repo_id, _, quant = model.partition(":")
    return repo_id, quant or None


def select_files(
    repo_id: str,
    files: list[str],
    *,
    load_format: str = "auto",
    gguf_file: str | None = None,
    quant: str | None = None,
    weights: bool = True,
    trust_remote_code: bool = False,
) -> list[str]:
    """The files of `files` (a repo's listing) that loading reads: one .gguf file when the repo is a GGUF
    repo (or one is asked for), else the top-level config and tokenizer files plus one weight format.
    A sharded checkpoint is represented by its index file here; `_shards` adds the shards it lists."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    if gguf_file is not None or quant is not None or load_format == "gguf":
        return [_pick_gguf(repo_id, ggufs, gguf_file, quant)]
    top = [f for f in files if "/" not in f]
    meta = [f for f in top if f in _META_FILES or f.endswith(".tiktoken")]
    if trust_remote_code:
        meta += [f for f in top if f.endswith(".py")]
    if not weights or load_format == "dummy":
        return sorted(meta)
    safetensors = [f for f in top if f.endswith(".safetensors")]
    bins = [f for f in top if f == "pytorch_model.bin" or f == _BIN_INDEX]
    chosen: list[str] = []
    if safetensors and load_format in ("auto", "safetensors"):
        if _ST_INDEX in top:
            chosen = [_ST_INDEX]
        else:
            chosen = ["model.safetensors"] if "model.safetensors" in top else safetensors
    elif bins and load_format in ("auto", "pt"):
        chosen = [_BIN_INDEX] if _BIN_INDEX in top else ["pytorch_model.bin"]
    elif "config.json" not in top and ggufs and load_format == "auto":
        return [_pick_gguf(repo_id, ggufs, None, None)]
    if not chosen:
        kind = {"auto": "safetensors, pytorch_model.bin or .gguf", "pt": "pytorch_model.bin"}
        raise HubError(
            repo_id,
            f"Hub repo {repo_id!r} has no {kind.get(load_format, load_format)} weights "
            f"(load_format={load_format!r}); its files: {', '.join(sorted(files)) or 'none'}",
        )
    return sorted(meta) + chosen


def _pick_gguf(repo_id: str, ggufs: list[str], gguf_file: str | None, quant: str | None) -> str:
    if gguf_file is not None:
        if gguf_file in ggufs:
            return gguf_file
        found = [f for f in ggufs if f.rsplit("/", 1)[-1] == gguf_file]
        if len(found) == 1:
            return found[0]
        raise HubError(
            repo_id,
            f"Hub repo {repo_id!r} has no GGUF file {gguf_file!r}; it has: {', '.join(ggufs) or 'none'}",
        )
    if quant is not None:
        # the quant type as a whole word of the file name ("Q4_K_M" matches "m.Q4_K_M.gguf", not "IQ4_K_M")
        word = re.compile(rf"(^|[-._/]){re.escape(quant.lower())}([-._]|$)")
        found = [f for f in ggufs if word.search(f.lower()[: -len(".gguf")])]
        if len(found) == 1:
            return found[0]
        what = "several GGUF files" if found else "no GGUF file"
        raise HubError(
            repo_id,
            f"Hub repo {repo_id!r} has {what} for {quant!r} ({', '.join(found or ggufs) or 'none'}); "
            "name one with gguf_file (--gguf-file)",
        )
    if len(ggufs) == 1:
        return ggufs[0]
    raise HubError(
        repo_id,
        f"Hub repo {repo_id!r} has {len(ggufs)} GGUF files ({', '.join(ggufs) or 'none'}): pick one with "
        f"'{repo_id}:QUANT' (e.g. :Q4_K_M) or gguf_file (--gguf-file)",
    )


def fetch(
    model: str,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    token: str | bool | None = None,
    gguf_file: str | None = None,
    load_format: str = "auto",
    weights: bool = True,
    trust_remote_code: bool = False,
) -> str:
    """The local path of Hub model `model` (the snapshot folder, or its .gguf file), downloading what is
    missing into the HF cache (`download_dir`, as vLLM's --download-dir). `weights=False`: a tokenizer only.
    HubError naming the repo for a missing, gated or private repo, a missing revision, or no Hub and no cache."""
    from huggingface_hub import constants

    repo_id, quant = split_quant(model)
    choose: dict[str, Any] = dict(
        load_format=load_format,
        gguf_file=gguf_file,
        quant=quant,
        weights=weights,
        trust_remote_code=trust_remote_code,
    )
    where = dict(revision=revision, cache_dir=download_dir, token=token)
    if getattr(constants, "HF_HUB_OFFLINE", False) or _env_true("HF_HUB_OFFLINE"):
        return _from_cache(repo_id, choose, where, reason="HF_HUB_OFFLINE is set")
    try:
        files = _hub_files(repo_id, revision, token)
        chosen = select_files(repo_id, files, **choose)
        logger.info(
            "fetching %d files of %s (revision %s) from %s",
            len(chosen),
            repo_id,
            revision or "main",
            constants.ENDPOINT,
        )
        return _snapshot(repo_id, chosen, where, local_files_only=False)
    except Exception as e:
        _raise_repo_error(repo_id, revision, e)
        if not _is_network_error(e):
            raise
        logger.warning(
            "cannot reach the Hub at %s for %s (%s: %s): trying the local cache",
            constants.ENDPOINT,
            repo_id,
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )
        path = _from_cache(
            repo_id, choose, where, reason=f"the Hub at {constants.ENDPOINT} cannot be reached"
        )
        logger.warning("using the cached copy of %s at %s (it may be out of date)", repo_id, path)
        return path


def _is_network_error(e: BaseException) -> bool:
    """A connection or timeout error of the HTTP client (httpx, whichever major version huggingface_hub
    ships), or an HTTP error status other than the repo errors (the Hub down: an OSError)."""
    status = getattr(getattr(e, "response", None), "status_code", None)
    if status is not None and 400 <= status < 500:
        return False  # the Hub answered: about the request, not the network
    if isinstance(e, (PermissionError, FileExistsError, IsADirectoryError, NotADirectoryError)):
        return False  # the local cache or --download-dir, not the network
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT):
        return False
    if isinstance(e, (OSError, TimeoutError)) and not isinstance(e, HubError):
        return True
    return any(
        c.__module__.split(".")[0].startswith("httpx")
        and c.__name__ in ("TransportError", "TimeoutException")
        for c in type(e).__mro__
    )


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "on", "yes", "true")


def _hub_files(repo_id: str, revision: str | None, token: str | bool | None) -> list[str]:
    from huggingface_hub import HfApi

    info = HfApi(token=token).model_info(repo_id, revision=revision)
    return [s.rfilename for s in info.siblings or []]


def _cached_files(repo_id: str, where: dict) -> list[str] | None:
    """The repo listing saved with the cached snapshot (None when there is none to read)."""
    try:
        from huggingface_hub import get_cached_repo_tree
    except ImportError:  # older huggingface_hub: the snapshot folder's own listing is used
        return None
    try:
        tree = get_cached_repo_tree(repo_id, revision=where["revision"], cache_dir=where["cache_dir"])
    except Exception:
        return None
    return [f.path for f in tree]


def _from_cache(repo_id: str, choose: dict, where: dict, reason: str) -> str:
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        files = _cached_files(repo_id, where)
        if files is None:
            folder = Path(_snapshot_download(repo_id, None, where, local_files_only=True))
            files = [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()]
        chosen = select_files(repo_id, files, **choose)
        return _snapshot(repo_id, chosen, where, local_files_only=True)
    except LocalEntryNotFoundError as e:
        rev = where["revision"] or "main"
        cache = where["cache_dir"] or _default_cache()
        raise HubError(
            repo_id,
            f"model {repo_id!r} (revision {rev}) is not a local path and is not in the Hugging Face cache "
            f"at {cache}, and {reason}: download it once with network access (or pass a local folder)",
        ) from e


def _default_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _snapshot(repo_id: str, chosen: list[str], where: dict, *, local_files_only: bool) -> str:
    """Download (or find in the cache) `chosen` plus the shards of any index among them; the path loading
    takes: the snapshot folder, or the .gguf file of a GGUF selection."""
    from huggingface_hub import hf_hub_download

    patterns = list(chosen)
    for index in (f for f in chosen if f.endswith(".index.json")):
        path = hf_hub_download(repo_id, index, local_files_only=local_files_only, **where)
        weight_map = json.loads(Path(path).read_text())["weight_map"]
        patterns += sorted(set(weight_map.values()))
    folder = _snapshot_download(repo_id, patterns, where, local_files_only=local_files_only)
    if len(chosen) == 1 and chosen[0].lower().endswith(".gguf"):
        return str(Path(folder) / chosen[0])
    return folder


def _snapshot_download(
    repo_id: str, patterns: list[str] | None, where: dict, *, local_files_only: bool
) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, allow_patterns=patterns, local_files_only=local_files_only, **where)


def _raise_repo_error(repo_id: str, revision: str | None, e: Exception) -> None:
    """HubError for what the Hub said about the repo itself (gone, gated, private, no such revision);
    returns for anything else (a network failure, the Hub down)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(
        e, RemoteEntryNotFoundError
    ):  # the repo exists; a file it lists (a shard of an index) does not
        raise HubError(repo_id, f"Hub repo {repo_id!r} lacks a file it needs: {e}") from e
    if isinstance(e, GatedRepoError) or status == 403:
        raise HubError(
            repo_id,
            f"Hub repo {repo_id!r} is gated or private ({status}): accept its license on the Hub and pass a "
            "token that can read it (HF_TOKEN, or hf_token=)",
        ) from e
    if isinstance(e, RevisionNotFoundError):
        raise HubError(repo_id, f"Hub repo {repo_id!r} has no revision {revision!r}") from e
    if isinstance(e, RepositoryNotFoundError) or status in (401, 404):
        raise HubError(
            repo_id,
            f"model {repo_id!r} is not a local path and not a model on the Hub at {constants.ENDPOINT} "
            f"({status}: no such repo, or a private or gated one the token cannot read; set HF_TOKEN)",
        ) from e
