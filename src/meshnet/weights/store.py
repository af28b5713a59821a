"""Where a member keeps weights: the manifests of its files, the parts it checked, its cache.

Under `root`:
- `manifests/<file key>.json`: a local file's manifest, made once (one read of the file) and
  kept while the file's path, size, mtime and inode stay the same.
- `checked/<file key>.json`: which parts of a local file were checked against which digest,
  so a reload of the same span hashes nothing.
- `cache/<digest>.gguf` and `cache/<digest>.json`: parts fetched from the mesh, written at
  their offsets in a sparse file laid out as the original (the existing loaders read it),
  and the record of the parts written, synced and checked. A part enters the record only
  after its bytes are on disk and hashed, so a crash never leaves an unchecked part in use.

`files` says what this member can serve: a digest's file and the parts of it known good.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from meshnet.errors import WeightsError
from meshnet.observe.progress import progress
from meshnet.weights.manifest import Manifest, Part, make_manifest, verify

log = logging.getLogger(__name__)


@dataclass
class HeldFile:
    """One model's bytes on this member: a file laid out as its manifest says, and the parts
    of it known to match."""

    path: Path
    manifest: Manifest
    held: set[str] = field(default_factory=set)
    cached: bool = False  # in the cache (evictable), not a file the operator gave

    def has(self, parts: Iterable[Part]) -> bool:
        return all(p.name in self.held for p in parts)

    def held_bytes(self) -> int:
        return sum(p.nbytes for p in self.manifest.parts if p.name in self.held)


def file_key(path: Path) -> str:
    """Names a local file's records: its absolute path, size, mtime and inode."""
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a reader sees the old file or the new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


class WeightStore:
    """A member's weights on disk; `cache_bytes` caps its cache (None: no cap)."""

    def __init__(self, root: Path, cache_bytes: int | None = None) -> None:
        self.root = root
        self.cache_bytes = cache_bytes
        self.files: dict[str, HeldFile] = {}  # digest -> what this member can serve
        self._saving = threading.Lock()  # parts are committed from several threads
        self._read_cache()

    def manifest_of(self, path: Path) -> Manifest:
        """The manifest of the local file at `path`, made once and kept beside our records."""
        kept = self.root / "manifests" / f"v2-{file_key(path)}.json"  # v2: types and shapes
        if kept.exists():
            try:
                return Manifest.model_validate_json(kept.read_bytes())
            except ValueError:
                log.warning("%s is damaged; fingerprinting %s again", kept, path)
        with progress(f"fingerprinting {path.name}") as task:
            manifest = make_manifest(path, task)
        write_atomic(kept, manifest.canonical())
        return manifest

    def offer_file(self, path: Path, manifest: Manifest) -> None:
        """Serve every part of a local file whose manifest this member made itself."""
        self.files[manifest.digest] = HeldFile(path, manifest, {p.name for p in manifest.parts})

    def check_local(self, path: Path, manifest: Manifest, parts: list[Part]) -> None:
        """Check `parts` of the local file `path` against `manifest` (WeightsError naming the
        part that differs), hashing only parts not checked before; then serve them."""
        record = self.root / "checked" / f"{file_key(path)}.json"
        known = _read_checked(record, manifest.digest)
        todo = [p for p in parts if p.name not in known]
        if todo:
            verify(path, manifest, todo)
            known |= {p.name for p in todo}
            write_atomic(
                record, json.dumps({"digest": manifest.digest, "parts": sorted(known)}).encode()
            )
        held = self.files.get(manifest.digest)
        if held is None or held.cached:
            self.files[manifest.digest] = held = HeldFile(path, manifest)
        held.held |= known

    def digests(self) -> list[str]:
        """The models this member holds parts of (registration tells the tracker)."""
        return sorted(self.files)

    # the cache

    def cache_entry(self, manifest: Manifest) -> HeldFile:
        """The cache's file for `manifest`'s model, created (sparse, full size) when new."""
        held = self.files.get(manifest.digest)
        if held is not None and held.cached:
            return held
        path = self.root / "cache" / f"{manifest.digest}.gguf"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab") as f:
            f.truncate(manifest.file_bytes)
        held = HeldFile(path, manifest, cached=True)
        self._save(held)
        if manifest.digest not in self.files:
            self.files[manifest.digest] = held
        return held

    def write(self, held: HeldFile, offset: int, data: bytes) -> None:
        """Put bytes fetched for a part in place (not yet in the record: `commit` does that
        once the whole part is here and hashed)."""
        try:
            fd = os.open(held.path, os.O_WRONLY)
            try:
                os.pwrite(fd, data, offset)
            finally:
                os.close(fd)
        except OSError as exc:
            raise WeightsError(
                f"cannot write to {held.path}: {exc.strerror}", field="cache"
            ) from None

    def commit(self, held: HeldFile, parts: list[Part]) -> None:
        """Record `parts` as held, once their bytes (hashed by the caller) are on disk: one
        sync for them all."""
        if not parts:
            return
        try:
            fd = os.open(held.path, os.O_WRONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise WeightsError(f"cannot sync {held.path}: {exc.strerror}", field="cache") from None
        with self._saving:
            held.held |= {p.name for p in parts}
            self._save(held)

    def touch(self, digest: str) -> None:
        """Mark a cached model used now (eviction goes least recently used first)."""
        held = self.files.get(digest)
        if held is not None and held.cached:
            os.utime(_record(held.path))

    def evict(self, keep: set[str]) -> list[str]:
        """Drop cached models not in `keep`, least recently used first, until the cache is
        within its cap; returns the digests dropped."""
        if self.cache_bytes is None:
            return []
        cached = [h for h in self.files.values() if h.cached]
        total = sum(h.held_bytes() for h in cached)
        gone = []
        for held in sorted(cached, key=lambda h: _record(h.path).stat().st_mtime_ns):
            if total <= self.cache_bytes:
                break
            if held.manifest.digest in keep:
                continue
            total -= held.held_bytes()
            _record(held.path).unlink(missing_ok=True)  # the record first: never a file
            held.path.unlink(missing_ok=True)  # whose record lists parts it lost
            del self.files[held.manifest.digest]
            gone.append(held.manifest.digest)
            log.info(
                "weights cache: dropped model %s... (least recently used)",
                held.manifest.digest[:16],
            )
        return gone

    def _save(self, held: HeldFile) -> None:
        body = {"manifest": held.manifest.model_dump(), "held": sorted(held.held)}
        write_atomic(_record(held.path), json.dumps(body).encode())

    def _read_cache(self) -> None:
        for record in sorted((self.root / "cache").glob("*.json")):
            try:
                body = json.loads(record.read_bytes())
                manifest = Manifest.model_validate(body["manifest"])
                held = {str(n) for n in body["held"]} & {p.name for p in manifest.parts}
            except (ValueError, KeyError, TypeError):
                log.warning("weights cache: %s is damaged; ignoring it", record)
                continue
            path = record.with_suffix(".gguf")
            if path.exists() and path.stat().st_size == manifest.file_bytes:
                self.files[manifest.digest] = HeldFile(path, manifest, held, cached=True)


def _record(path: Path) -> Path:
    return path.with_suffix(".json")


def _read_checked(record: Path, digest: str) -> set[str]:
    try:
        body = json.loads(record.read_bytes())
    except (OSError, ValueError):
        return set()
    if not isinstance(body, dict) or body.get("digest") != digest:
        return set()
    return {str(n) for n in body.get("parts", [])}
