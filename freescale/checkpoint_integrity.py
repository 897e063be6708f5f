"""Checkpoint checksums: every byte DCP writes is hashed at save and verified when it is read back.

DCP stores each tensor (or byte blob) as one *item*: a range ``[offset, offset + length)`` of a data file
``__R_N.distcp``, named in its ``.metadata``.  It checks no content on load: a flipped byte in a table loads
silently.  Here:

- **Save** (``VerifyingWriter``, a ``FileSystemWriter``): after a rank's files are written (and fsynced by
  DCP), the rank hashes each item it wrote, reading the bytes back (from the page cache, just written), and
  writes the hashes to a side file of its own, ``__R_checksums.json`` (fsynced).  Hashing overlaps nothing:
  it runs where DCP's write ran (the checkpoint writer's thread for background saves), after the write.
- **Commit** (``seal``, rank 0, every rank's files written): the side files are merged into one
  ``checksums.json`` (each data file's size and items' hashes, and the ``.metadata`` file's hash), fsynced;
  its own hash goes into ``freescale.json``, which carries a hash of its own content too (``stamp``).
- **Load** (``check_files`` then ``VerifyingReader``): before DCP runs, the manifest's hash, the
  ``.metadata`` hash and every data file's size are checked (a truncated or missing file, a damaged
  manifest: no DCP traceback); DCP then reads through ``VerifyingReader``, which hashes each item as it
  reads it and refuses one that differs, naming the file and byte range.  A rank verifies exactly what it
  loads: under another sharding plan it reads (and so checks) only the items that overlap its shards.
- **Audit** (``verify_all``, ``freescale checkpoint inspect --verify``): every item of every file, and that
  the items cover each file exactly, so every byte is checked.

xxh3-64 (``xxhash``): about 10x the speed of a page-cache read on one core, so verifying costs a small
fraction of the load itself.  A checkpoint written before checksums existed has no ``integrity`` entry:
it loads unverified (``is_verified`` says so; the caller reports it).
"""

from __future__ import annotations

import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import xxhash
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.futures import Future

from freescale.write_pacing import PIECE, PacedFileSystem, Pacer

ALGORITHM = "xxh3_64"
MANIFEST = "checksums.json"
METADATA = ".metadata"
SIDE_SUFFIX = "checksums.json"
_CHUNK = 16 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, phrased for the user (names the path)."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint whose bytes are not what was written (or are missing): the message names the file and
    the reason.  Unlike a checkpoint that does not fit the model, an older one may still be good."""


def digest(data: bytes | memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def file_digest(path: Path, offset: int = 0, length: int | None = None) -> tuple[str, int]:
    """The hash of ``length`` bytes of ``path`` from ``offset`` (to the end when None), and how many bytes
    were there to read."""
    with path.open("rb") as fh:
        return _range_digest(fh, offset, length)


def _range_digest(fh: IO[bytes], offset: int, length: int | None,
                  pacer: Pacer | None = None) -> tuple[str, int]:
    """``file_digest`` on a file already open (a file's items hashed through one open); with ``pacer``, read
    and hashed in small pieces with a pause after each (``write_pacing``)."""
    hasher, read = xxhash.xxh3_64(), 0
    fh.seek(offset)
    left = length
    piece = PIECE if pacer is not None and pacer.active else _CHUNK
    while left is None or left > 0:
        if pacer is not None:
            pacer.pause()
        chunk = fh.read(piece if left is None else min(piece, left))
        if not chunk:
            break
        hasher.update(chunk)
        read += len(chunk)
        if left is not None:
            left -= len(chunk)
    return hasher.hexdigest(), read


def _fsync_write(path: Path, text: str) -> None:
    with path.open("w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


class VerifyingWriter(FileSystemWriter):
    """DCP's file writer, plus a side file of this rank's item hashes (see the module docstring).  With
    ``pacer``, its files are written and hashed at the pacer's share of a core (``write_pacing``)."""

    def __init__(self, path: Path, pacer: Pacer | None = None) -> None:
        super().__init__(path)
        self.pacer = pacer
        if pacer is not None:
            self.fs = PacedFileSystem(pacer)

    def write_data(self, plan: Any, planner: Any) -> Future[Any]:
        future = super().write_data(plan, planner)
        results = future.wait()
        items: dict[str, list[list[Any]]] = {}
        for result in results:
            info: _StorageInfo = result.storage_data
            items.setdefault(info.relative_path, []).append([int(info.offset), int(info.length)])
        root = Path(self.path)
        for name, ranges in items.items():
            with (root / name).open("rb") as fh:
                for entry in ranges:
                    entry.append(_range_digest(fh, entry[0], entry[1], self.pacer)[0])
        prefix = plan.storage_data.prefix
        _fsync_write(root / f"{prefix}{SIDE_SUFFIX}", json.dumps({"algorithm": ALGORITHM, "items": items}))
        return future


def seal(partial: Path) -> str:
    """Rank 0 at commit, every rank's files written: merge the side files into ``checksums.json`` (with each
    file's size and the ``.metadata`` hash), fsync it; its hash, for ``freescale.json``."""
    files: dict[str, dict[str, Any]] = {}
    sides = sorted(partial.glob(f"__*_{SIDE_SUFFIX}"))
    for side in sides:
        for name, ranges in json.loads(side.read_text())["items"].items():
            files[name] = {"size": (partial / name).stat().st_size, "items": sorted(ranges)}
    manifest = {"algorithm": ALGORITHM, "metadata": file_digest(partial / METADATA)[0], "files": files}
    text = json.dumps(manifest, sort_keys=True)
    _fsync_write(partial / MANIFEST, text)
    for side in sides:
        side.unlink()
    return digest(text.encode())


def stamp(meta: dict[str, Any], manifest_hash: str) -> dict[str, Any]:
    """``freescale.json``'s content: ``meta`` with the manifest's hash, and a hash of all of it."""
    body = {**meta, "integrity": {"algorithm": ALGORITHM, "manifest": manifest_hash}}
    return {**body, "meta_hash": digest(json.dumps(body, sort_keys=True).encode())}


def check_meta(path: Path, meta: dict[str, Any]) -> None:
    """``freescale.json`` as written: its own hash matches (damaged if it differs, or if it is gone from a checkpoint
    written with checksums, which its ``integrity`` entry or a ``checksums.json`` beside it says: deleting the hash
    never turns verification off), and the fields freescale reads have the types it wrote (``check_fields``: a
    checkpoint older than checksums has nothing else to catch a hand edit before it meets the resume)."""
    where = path / "freescale.json"
    expected = meta.get("meta_hash")
    if expected is None and ("integrity" in meta or (path / MANIFEST).exists()):
        raise CheckpointDamaged(f"{where}: its checksum is gone, though the checkpoint was written with checksums "
                                "(edited or damaged)")
    body = {k: v for k, v in meta.items() if k != "meta_hash"}
    if expected is not None and digest(json.dumps(body, sort_keys=True).encode()) != expected:
        raise CheckpointDamaged(f"{where}: its content does not match its checksum")
    check_fields(path, meta)


_OBJECT_FIELDS = {"data": (dict,), "plan": (dict,), "layouts": (dict,), "config": (dict, type(None)),
                  "ft": (dict, type(None)), "validation": (dict, type(None))}
"""``freescale.json``'s top-level objects and the types freescale writes them as."""


def check_fields(path: Path, meta: dict[str, Any]) -> None:
    """The fields of ``freescale.json`` that freescale reads, where present, each of the type it wrote: the step
    (a number, the one its directory is named after), the shape, the data position, each table's plan and layout;
    else ``CheckpointDamaged`` naming the field."""
    where = path / "freescale.json"

    def refuse(field: str, value: Any, wanted: str) -> None:
        raise CheckpointDamaged(f"{where}: field '{field}' is {json.dumps(value)[:40]}, not {wanted}")

    step, named = meta.get("step"), re.fullmatch(r"step_(\d+)", path.name)
    if type(step) is not int or step < 0:
        refuse("step", step, "a step number")
    if named and int(named.group(1)) != step:
        refuse("step", step, f"the step its directory {path.name} is named after")
    if "world_size" in meta and (type(meta["world_size"]) is not int or meta["world_size"] < 1):
        refuse("world_size", meta["world_size"], "a number of ranks")
    for field, types in _OBJECT_FIELDS.items():
        if field in meta and not isinstance(meta[field], types):
            refuse(field, meta[field], "an object" if types == (dict,) else "an object or null")
    groups = (meta.get("ft") or {}).get("replicas", 1)
    if type(groups) is not int or groups < 1:
        refuse("ft.replicas", groups, "a number of replica groups")
    for table, plan in (meta.get("plan") or {}).items():
        if not isinstance(plan, dict) or not all(isinstance(plan.get(key, []), list) for key in ("ranks", "shards")) \
                or not all(isinstance(shard, dict) for shard in plan.get("shards", [])):
            refuse(f"plan.{table}", plan, "a table's plan (its ranks and shards)")
    for name, layout in (meta.get("layouts") or {}).items():
        if not isinstance(layout, dict) or not isinstance(layout.get("cuts"), list) \
                or not all(type(layout.get(key)) is int for key in ("dim", "rows")):
            refuse(f"layouts.{name}", layout, "a table's layout (its cuts, dim and rows)")


def is_verified(meta: dict[str, Any]) -> bool:
    """Whether the checkpoint was written with checksums (older ones load unverified)."""
    return "integrity" in meta


@dataclass
class Manifest:
    """``checksums.json``: per data file its size and ``{offset: (length, hash)}``."""

    metadata: str
    files: dict[str, tuple[int, dict[int, tuple[int, str]]]]

    def expected(self, name: str, offset: int, length: int) -> str | None:
        entry = self.files.get(name)
        item = entry[1].get(offset) if entry else None
        return item[1] if item is not None and item[0] == length else None


def read_manifest(path: Path, meta: dict[str, Any]) -> Manifest:
    """The checkpoint's manifest, checked against the hash ``freescale.json`` holds for it."""
    where = path / MANIFEST
    try:
        text = where.read_text()
    except OSError as exc:
        raise CheckpointDamaged(f"{where}: unreadable ({exc.strerror or type(exc).__name__})") from None
    if digest(text.encode()) != meta["integrity"]["manifest"]:
        raise CheckpointDamaged(f"{where}: its content does not match its checksum in freescale.json")
    raw = json.loads(text)
    files = {name: (int(entry["size"]), {int(o): (int(n), str(h)) for o, n, h in entry["items"]})
             for name, entry in raw["files"].items()}
    return Manifest(metadata=raw["metadata"], files=files)


def check_files(path: Path, manifest: Manifest) -> None:
    """Cheap checks before DCP runs: ``.metadata``'s hash, and every data file there at its full size."""
    metadata = path / METADATA
    if not metadata.is_file():
        raise CheckpointDamaged(f"{metadata}: missing")
    if file_digest(metadata)[0] != manifest.metadata:
        raise CheckpointDamaged(f"{metadata}: its content does not match its checksum")
    for name, (size, _) in sorted(manifest.files.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointDamaged(f"{file}: missing")
        if file.stat().st_size != size:
            how = "truncated" if file.stat().st_size < size else "grown"
            raise CheckpointDamaged(f"{file}: {file.stat().st_size} bytes, {size} were written ({how})")


class VerifyingReader(FileSystemReader):
    """DCP's file reader that hashes each item it reads and refuses one that differs from the manifest."""

    def __init__(self, path: Path, manifest: Manifest) -> None:
        super().__init__(str(path))
        self.manifest, self.root = manifest, path

    def _slice_file(self, file: Any, sinfo: _StorageInfo) -> IO[bytes]:
        name, offset, length = sinfo.relative_path, int(sinfo.offset), int(sinfo.length)
        file.seek(offset)
        data = file.read(length)
        expected = self.manifest.expected(name, offset, length)
        where = f"{self.root / name}: bytes {offset}..{offset + length}"
        if expected is None:
            raise CheckpointDamaged(f"{where} are not in {MANIFEST} (the metadata and the manifest disagree)")
        if len(data) != length or digest(data) != expected:
            raise CheckpointDamaged(f"{where} do not match their checksum")
        return io.BytesIO(data)


def verify_all(path: Path, meta: dict[str, Any]) -> int:
    """Every byte of the checkpoint against its checksums (``inspect --verify``): the bytes checked.  Raises
    ``CheckpointDamaged`` at the first difference."""
    check_meta(path, meta)
    if not is_verified(meta):
        raise CheckpointDamaged(f"{path}: written without checksums (before they existed): cannot be verified")
    manifest = read_manifest(path, meta)
    check_files(path, manifest)
    checked = 0
    for name, (size, items) in sorted(manifest.files.items()):
        with (path / name).open("rb") as fh:
            end, checked = _verify_file(fh, path / name, items, checked)
        if end != size:
            raise CheckpointDamaged(f"{path / name}: bytes {end}..{size} are covered by no checksum")
    return checked + (path / METADATA).stat().st_size


def _verify_file(fh: IO[bytes], where: Path, items: dict[int, tuple[int, str]], checked: int) -> tuple[int, int]:
    """Every item of one data file, in order, covering it from byte 0: (where they end, bytes checked so far)."""
    end = 0
    for offset, (length, expected) in sorted(items.items()):
        if offset != end:
            raise CheckpointDamaged(f"{where}: bytes {end}..{offset} are covered by no checksum")
        found, read = _range_digest(fh, offset, length)
        if read != length or found != expected:
            raise CheckpointDamaged(f"{where}: bytes {offset}..{offset + length} do not match their checksum")
        end, checked = offset + length, checked + length
    return end, checked


__all__ = ["CheckpointDamaged", "CheckpointError", "Manifest", "VerifyingReader", "VerifyingWriter", "check_files", "check_meta",
           "file_digest", "is_verified", "read_manifest", "seal", "stamp", "verify_all"]
