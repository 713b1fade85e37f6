"""manifest.json: everything a device or the host needs to know about an export, and checks."""
from __future__ import annotations

import json
from pathlib import Path

FORMAT = "zerolock-export"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MODES = ("zerolock", "bp")  # which programs an export holds: manifest["modes"]


class ManifestError(Exception):
    """An export directory that is missing, incomplete, or whose files do not match."""


from zl_common.hashing import sha256_file  # noqa: E402  (one implementation, re-exported here)


def file_entry(root: Path, path: Path) -> dict:
    return {"path": str(path.relative_to(root)), "sha256": sha256_file(path), "size": path.stat().st_size}


def tensor_desc(name: str, t) -> dict:
    return {"name": name, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}


def write_manifest(root: Path, manifest: dict) -> None:
    (Path(root) / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def load_manifest(root: Path, check_files: bool = True) -> dict:
    """Read and validate an export directory's manifest; with check_files, every listed file
    must exist with the recorded size and sha256."""
    root = Path(root)
    path = root / MANIFEST
    fix = "run zl-export --out DIR and pass that DIR"
    if not path.is_file():
        raise ManifestError(f"{root} has no {MANIFEST}, so it is not a zl-export output: {fix}")
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path} is not valid JSON ({e.msg}, line {e.lineno}): re-export with zl-export") from None
    if m.get("format") != FORMAT:
        raise ManifestError(f"{path} is not a ZeroLock export manifest: {fix}")
    if m.get("format_version") != FORMAT_VERSION:
        raise ManifestError(f"{path} has format version {m.get('format_version')}, this tool reads "
                            f"{FORMAT_VERSION}: re-export with this version of zl-export")
    if check_files:
        for f in m["files"]:
            p = root / f["path"]
            if not p.is_file():
                raise ManifestError(f"{p} listed in the manifest is missing: re-export, or copy the whole directory")
            if p.stat().st_size != f["size"] or sha256_file(p) != f["sha256"]:
                raise ManifestError(f"{p} does not match its sha256 in the manifest (corrupt or changed): re-export it")
    return m


def chunk_entry_for(chunk: dict, mode: str = "zerolock") -> dict:
    """The chunk entry with program, weights and methods of the given mode, as
    zl_common.program.ChunkProgram takes it: "zerolock" (the entry itself) or "bp" (the entry
    with its "bp" object's fields laid over it)."""
    if mode == "bp":
        if "bp" not in chunk:
            raise ManifestError(f"chunk {chunk.get('index')} has no BP program: re-export with zl-export --mode bp or both")
        return {**chunk, **chunk["bp"]}
    if mode == "zerolock":
        if "program" not in chunk:
            raise ManifestError(f"chunk {chunk.get('index')} has no ZeroLock program (a --mode bp export): "
                                "re-export with zl-export --mode zerolock or both")
        return chunk
    raise ValueError(f"unknown mode {mode!r}: use one of {MODES}")


def ptd_contents(path: Path) -> dict:
    """key -> (tensor layout, bytes) of an ExecuTorch .ptd (named data) file."""
    from executorch.exir._serialize._cord import Cord
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    payload = FlatTensorSerializer().deserialize(Cord(Path(path).read_bytes()))
    return {k: (e.tensor_layout, bytes(payload.buffers[e.buffer_index])) for k, e in payload.named_data.items()}
