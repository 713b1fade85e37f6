"""manifest.json: writing it (zl-export), and the reading side (zl_common.manifest) under the names the exporter uses."""
from __future__ import annotations

import json
from pathlib import Path

# the reading side lives below the runtime, which reads it too (zl_common/manifest.py)
from zl_common.hashing import sha256_file
from zl_common.manifest import FORMAT, FORMAT_VERSION, MANIFEST, MODES, ChunkEntry, Manifest, ManifestError
from zl_common.manifest import read_manifest as load_manifest

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST", "MODES", "ChunkEntry", "Manifest", "ManifestError", "file_entry",
           "load_manifest", "ptd_contents", "tensor_desc", "write_manifest"]


def file_entry(root: Path, path: Path) -> dict:
    return {"path": str(path.relative_to(root)), "sha256": sha256_file(path), "size": path.stat().st_size}


def tensor_desc(name: str, t) -> dict:
    return {"name": name, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}


def write_manifest(root: Path, manifest: dict) -> None:
    (Path(root) / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def ptd_contents(path: Path) -> dict:
    """key -> (tensor layout, bytes) of an ExecuTorch .ptd (named data) file."""
    from executorch.exir._serialize._cord import Cord
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    payload = FlatTensorSerializer().deserialize(Cord(Path(path).read_bytes()))
    return {k: (e.tensor_layout, bytes(payload.buffers[e.buffer_index])) for k, e in payload.named_data.items()}
