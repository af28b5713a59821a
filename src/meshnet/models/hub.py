"""Hub ids (`org/name`) through the local Hugging Face cache.

Only the config, tokenizer files, the index and the safetensors files that hold a node's layers
are fetched; with no network (or `HF_HUB_OFFLINE=1`) whatever is cached is used.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from meshnet.errors import ModelError
from meshnet.observe.progress import progress

log = logging.getLogger(__name__)

SMALL_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "model.safetensors.index.json",
]


def _fetch(repo_id: str, filename: str, cache_dir: Path | None) -> Path | None:
    """A file from the cache, else from the hub; None when neither has it."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    kwargs: dict[str, Any] = {"cache_dir": str(cache_dir) if cache_dir else None}
    try:
        return Path(hf_hub_download(repo_id, filename, local_files_only=True, **kwargs))
    except LocalEntryNotFoundError:
        pass
    try:
        return Path(hf_hub_download(repo_id, filename, **kwargs))
    except (LocalEntryNotFoundError, EntryNotFoundError, OSError) as exc:
        log.debug("%s/%s not available: %s", repo_id, filename, exc)
        return None


def hub_config(repo_id: str, cache_dir: Path | None) -> tuple[Path, dict[str, Any]]:
    """A hub id's config (its path in the cache, and its fields) with the small files beside
    it (tokenizer, generation config, weight index); weights come later, per span."""
    config_path = _fetch(repo_id, "config.json", cache_dir)
    if config_path is None:
        raise ModelError(f"model {repo_id!r} is neither cached nor reachable on the hub")
    for name in SMALL_FILES[1:]:
        _fetch(repo_id, name, cache_dir)
    return config_path, json.loads(config_path.read_text())


def fetch_weight_files(repo_id: str, files: set[str], cache_dir: Path | None) -> None:
    """Make sure each named safetensors file of hub model `repo_id` is in the cache."""
    with progress(f"fetching {repo_id} weight files", len(files)) as task:
        for file in sorted(files):
            if _fetch(repo_id, file, cache_dir) is None:
                raise ModelError(
                    f"{repo_id}: weight file {file} is neither cached nor reachable on the hub"
                )
            task.advance()
