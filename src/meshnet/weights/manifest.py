"""A model known by its content: the manifest of a GGUF file and its digest (ADR-0054).

A manifest lists the file's parts: its header (metadata, tokenizer, chat template and the
tensor index, everything before the tensor data) and each tensor, with its byte range and
SHA-256. The model's **digest** is the SHA-256 of the manifest's canonical JSON, so two files
with the same digest hold the same bytes wherever it matters, and a part fetched from anyone
is checked against the manifest the tracker's digest names.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from meshnet.errors import CopyDiffersError, WeightsError
from meshnet.models.gguf_file import HEAD_TENSORS, layer_prefix, read_gguf
from meshnet.observe.progress import Task
from meshnet.types import LayerSpan

HEADER = "~header"  # the part before the tensor data (no GGUF tensor name starts with ~)
DIGEST_PATTERN = r"^[0-9a-f]{64}$"
MAX_PARTS = 100_000
READ_BYTES = 8 << 20  # what hashing reads at a time


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Part(BaseModel):
    """One byte range of the file: the header or one tensor."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=256)
    offset: int = Field(ge=0)
    nbytes: int = Field(ge=0)
    sha256: str = Field(pattern=DIGEST_PATTERN)
    # a tensor's GGML type and shape (GGUF order); the header has neither
    ggml_type: int | None = Field(default=None, ge=0, le=1024)
    shape: list[int] = Field(default=[], max_length=8)

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class Manifest(BaseModel):
    """A GGUF file's parts and size; its `digest` names the model in directives."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["gguf"] = "gguf"
    file_bytes: int = Field(ge=0)
    parts: list[Part] = Field(min_length=1, max_length=MAX_PARTS)  # the header first

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if self.parts[0].name != HEADER or self.parts[0].offset != 0:
            raise ValueError(f"a manifest starts with its {HEADER} part at offset 0")
        names = {p.name for p in self.parts}
        if len(names) != len(self.parts):
            raise ValueError("a manifest names each part once")
        beyond = next((p for p in self.parts if p.end > self.file_bytes), None)
        if beyond is not None:
            raise ValueError(f"part {beyond.name!r} ends past the file ({self.file_bytes} bytes)")
        return self

    @property
    def digest(self) -> str:
        """SHA-256 of the canonical JSON: what `name@digest` and directives carry."""
        return sha256_hex(self.canonical())

    def canonical(self) -> bytes:
        return json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":")).encode()

    def part(self, name: str) -> Part | None:
        return next((p for p in self.parts if p.name == name), None)

    def span_parts(self, span: LayerSpan, *, entry: bool) -> list[Part]:
        """The parts a node needs to serve `span`: the header, the span's layers, the
        tensors outside layers that layers use; the head's too for an entry span."""
        prefixes = tuple(layer_prefix(i) for i in span)
        head = entry and span.start == 0
        return [p for p in self.parts if _needed(p.name, prefixes, head)]


def _needed(name: str, prefixes: tuple[str, ...], head: bool) -> bool:
    if name == HEADER or name.startswith(prefixes):
        return True
    if name.startswith("blk."):
        return False
    return head or name not in HEAD_TENSORS


def parse_manifest(body: bytes, digest: str) -> Manifest:
    """A manifest sent by anyone, accepted only when it is the one `digest` names."""
    try:
        manifest = Manifest.model_validate_json(body)
    except ValueError as exc:
        raise WeightsError(f"not a manifest: {str(exc)[:300]}", field="manifest") from None
    if manifest.digest != digest:
        raise WeightsError(
            f"the manifest sent has digest {manifest.digest[:16]}..., not {digest[:16]}...",
            field="manifest",
        )
    return manifest


def make_manifest(path: Path, task: Task | None = None) -> Manifest:
    """The manifest of the GGUF file at `path`: one read of every byte (hashing)."""
    index = read_gguf(path)
    parts = [Part(name=HEADER, offset=0, nbytes=index.data_start, sha256="0" * 64)] + [
        Part(
            name=t.name,
            offset=t.offset,
            nbytes=t.nbytes,
            sha256="0" * 64,
            ggml_type=int(t.tensor_type),
            shape=list(t.shape),
        )
        for t in index.tensors
    ]
    if task is not None:
        task.update(0, sum(p.nbytes for p in parts))
    with path.open("rb") as f:
        hashed = [
            p.model_copy(update={"sha256": pread_hash(f.fileno(), p.offset, p.nbytes, task)})
            for p in parts
        ]
    return Manifest(file_bytes=path.stat().st_size, parts=hashed)


def verify(path: Path, manifest: Manifest, parts: Iterable[Part]) -> None:
    """Check `parts` of the local file at `path` against `manifest` (CopyDiffersError naming
    a part that differs): the bytes a load is about to read, hashed on every core."""
    size = path.stat().st_size
    if size != manifest.file_bytes:
        raise CopyDiffersError(
            f"{path.name} has {size} bytes; model {manifest.digest[:16]}... has "
            f"{manifest.file_bytes}: another file under the same name",
            field="weights",
        )
    parts = list(parts)
    with path.open("rb") as f, ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        hashes = pool.map(lambda p: pread_hash(f.fileno(), p.offset, p.nbytes), parts)
        wrong = next((p for p, h in zip(parts, hashes, strict=True) if h != p.sha256), None)
    if wrong is not None:
        what = (
            "header (metadata, tokenizer or tensor index)"
            if wrong.name == HEADER
            else f"tensor {wrong.name!r}"
        )
        raise CopyDiffersError(
            f"{path.name}: its {what} differs from model {manifest.digest[:16]}...'s "
            "manifest: not loading it",
            field="weights",
        )


def pread_hash(fd: int, offset: int, nbytes: int, task: Task | None = None) -> str:
    """SHA-256 of `nbytes` bytes of the open file `fd` from `offset`, read `READ_BYTES` at a
    time (threads may share `fd`: no seek; hashlib lets go of the GIL while it hashes)."""
    digest = hashlib.sha256()
    done = 0
    while done < nbytes:
        chunk = os.pread(fd, min(nbytes - done, READ_BYTES), offset + done)
        if not chunk:
            raise WeightsError(f"the file ends before byte {offset + nbytes}")
        digest.update(chunk)
        done += len(chunk)
        if task is not None:
            task.advance(len(chunk))
    return digest.hexdigest()
