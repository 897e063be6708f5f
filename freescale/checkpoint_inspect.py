"""``freescale checkpoint inspect PATH``: what a checkpoint holds, read without a model or a process group.

From ``freescale.json`` (written last by ``checkpoint.save``): the step, the world size and replica
groups that wrote it, the data position, each table's plan (``reshard.plan_summary``) and row-wise
optimizer layout, a digest of the run's config.  From DCP's ``.metadata``: every tensor's logical
size, bytes by part (model, optimizer, row-wise fragments), and that every file it names is there
and long enough.  What every load checks first, too (the manifest's and ``.metadata``'s hashes, every data file's
size); with ``verify``, every byte of every file against the checksums written with it
(``checkpoint_integrity.verify_all``).  PATH is one checkpoint, a checkpoint directory or a run's output_dir (the
latest complete one).
Anything unusable is one ``CheckpointError`` line naming the path.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

from freescale.checkpoint import PARTIAL_SUFFIX, CheckpointError, latest, read_meta
from freescale.checkpoint_integrity import check_files, is_verified, read_manifest, verify_all


def resolve(path: str) -> Path:
    where = Path(path)
    if where.name.endswith(PARTIAL_SUFFIX):
        raise CheckpointError(f"{where}: a save in progress, or one killed mid-way: never loaded")
    if not where.exists():
        raise CheckpointError(f"{where}: no such checkpoint or directory")
    if (where / ".metadata").exists() or (where / "freescale.json").exists():
        return where
    found = latest(where) or latest(where / "checkpoints")  # a checkpoint directory, or a run's output_dir
    if found is None:
        raise CheckpointError(f"{where}: no complete checkpoint there (nor in {where / 'checkpoints'})")
    return found


def inspect(path: str, verify: bool = False) -> dict[str, Any]:
    """Everything ``freescale checkpoint inspect`` prints, as one JSON-able dict.  ``verify``: every byte
    checked against its checksum first (a difference raises ``CheckpointDamaged`` naming the file)."""
    where = resolve(path)
    meta = read_meta(where)
    verified = verify_all(where, meta) if verify else None
    if not verify and is_verified(meta):  # what every load checks first, cheap: the manifest, .metadata, file sizes
        check_files(where, read_manifest(where, meta))
    tensors = _tensors(where)
    config = meta.get("config") or {}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    loader = (meta.get("data") or {}).get("loader", meta.get("data") or {})
    tables = []
    for table, plan in sorted((meta.get("plan") or {}).items()):
        weight = next((t for t in tensors if t["part"] == "model" and t["name"].endswith(f".{table}.weight")), None)
        layout = next((v for k, v in (meta.get("layouts") or {}).items() if k.split("/")[0].endswith(f".{table}.weight")),
                      None)
        tables.append({"table": table, "rows x dim": "x".join(map(str, weight["size"])) if weight else "?",
                       "sharding": plan.get("type"), "ranks": ",".join(map(str, plan.get("ranks", []))),
                       "shards": len(plan.get("shards", [])),
                       "row-wise ranges": len(layout["cuts"]) - 1 if layout else 0})
    parts: dict[str, int] = {}
    for t in tensors:
        parts[t["part"]] = parts.get(t["part"], 0) + t["bytes"]
    return {
        "path": str(where), "step": meta.get("step"), "world_size": meta.get("world_size"),
        "replica_groups": (meta.get("ft") or {}).get("replicas", 1), "config_digest": digest,
        "model": (config.get("model") or {}).get("kind"),
        "global_batch_size": loader.get("global_batch_size"),
        "position": {"epoch": loader.get("epoch"), "step": loader.get("step"),
                     "carried_rows": sum(len(rows) for _, _, rows in loader.get("carry") or []),
                     "resumed_from_another_shape": bool(loader.get("reshaped_from"))},
        "tables": tables, "bytes": parts, "tensors": len(tensors),
        "checksums": is_verified(meta), "verified_bytes": verified,
    }


def _tensors(where: Path) -> list[dict[str, Any]]:
    """Every tensor of the DCP checkpoint: name, part, logical size, bytes; files checked against it."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = FileSystemReader(str(where)).read_metadata()
    except Exception as exc:  # a missing or truncated .metadata: pickle, OSError, EOFError ...
        raise CheckpointError(f"{where}: unreadable checkpoint metadata ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}); corrupt or partial") from None
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), int(info.offset) + int(info.length))
    for name, end in sorted(ends.items()):
        file = where / name
        if not file.is_file():
            raise CheckpointError(f"{where}: corrupt or partial: {name} is missing")
        if file.stat().st_size < end:
            raise CheckpointError(f"{where}: corrupt or partial: {name} holds {file.stat().st_size} bytes, "
                                  f"the metadata needs {end}")
    found = []
    for name, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            size = list(md.size)
            found.append({"name": name, "part": name.split(".", 1)[0], "size": size,
                          "bytes": math.prod(size) * md.properties.dtype.itemsize})
    return found


def print_inspection(found: dict[str, Any]) -> None:
    from freescale.tables import print_table

    p = found["position"]
    print(f"checkpoint {found['path']}")
    print(f"  step {found['step']}, written by {found['replica_groups']} replica group(s) of {found['world_size']} "
          f"rank(s); model {found['model']}; config digest {found['config_digest']}")
    print(f"  data: epoch {p['epoch']}, step {p['step']} of a global batch of {found['global_batch_size']}; "
          f"{p['carried_rows']} rows carried" + ("; an epoch resumed from another shape" if
                                                 p["resumed_from_another_shape"] else ""))
    mb = {k: round(v / 2**20, 2) for k, v in sorted(found["bytes"].items())}
    print(f"  {found['tensors']} tensors, MB by part: {mb}")
    if found["verified_bytes"] is not None:
        print(f"  verified: every byte ({found['verified_bytes']:,}) matches its checksum")
    elif not found["checksums"]:
        print("  written without checksums (before they existed): its bytes cannot be verified")
    if found["tables"]:
        print_table(found["tables"], ["table", "rows x dim", "sharding", "ranks", "shards", "row-wise ranges"])


__all__ = ["inspect", "print_inspection", "resolve"]
