"""manifest.json read as typed records: what the stage, the device, the coordinator and the
backends take from an export (exporter/export.py writes it; exporter/manifest.py re-exports this).

A chunk's entry holds its ZeroLock program (program, weights, methods, first_input, ...) and, in
an export with BP programs, a "bp" object with the BP program's fields. `ChunkEntry.for_mode`
is the one place that lays the "bp" object over the entry; `json` is the entry as written (or as
laid over), what zl_common.program's ChunkProgram takes. The JSON format is unchanged: the
Kotlin phone reads the same file (ManifestRunnerFactory)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .hashing import sha256_file

FORMAT = "zerolock-export"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MODES = ("zerolock", "bp")  # which programs an export holds: manifest["modes"]
FIX = "re-export with zl-export"
_FILE_KEYS = ("program", "weights", "lora_init", "eager_weights")  # a chunk's entries that name files


class ManifestError(Exception):
    """An export directory that is missing, incomplete, or whose files do not match."""


def program_mode(schedule: str) -> str:
    """The program a schedule runs: ZeroLock its own, the BP baselines (gpipe, 1f1b, ...) the BP one."""
    return "zerolock" if schedule == "zerolock" else "bp"


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise ManifestError(f"{where}: {what}: {FIX}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class FileEntry:
    """One of manifest["files"]: a file of the export, by its path relative to the export dir."""
    path: str
    sha256: str
    size: int


@dataclass(frozen=True)
class ChunkEntry:
    """One of manifest["chunks"]. The file names are None where the entry has none (a bp-only
    export's entry has no ZeroLock program; `for_mode("bp")` gives the BP one)."""
    index: int
    layers: tuple[int, int]
    lora_init: str
    first_input: str | None
    program: str | None
    weights: str | None
    eager_weights: str | None
    saved_activation_bytes: int | None
    last: bool | None  # a BP entry: whether its program ends in the loss
    has_bp: bool
    json: dict = field(repr=False, compare=False)  # the entry as written: what the programs read

    @classmethod
    def from_json(cls, c, where: str = MANIFEST) -> "ChunkEntry":
        _need(isinstance(c, dict), where, f"a chunk entry is {type(c).__name__}, not an object")
        idx = c.get("index")
        _need(_is_int(idx) and idx >= 0, where, f"a chunk entry's index is {idx!r}, not a non-negative integer")
        here = f"{where}: chunk {idx}"
        layers = c.get("layers")
        _need(isinstance(layers, list) and len(layers) == 2 and all(_is_int(v) for v in layers), here,
              f"layers is {layers!r}, not [first, last]")
        for key in _FILE_KEYS + ("first_input",):
            _need(c.get(key) is None or isinstance(c[key], str), here, f"{key} is {c.get(key)!r}, not a name")
        _need(c.get("lora_init") is not None, here, "has no lora_init (the LoRA it starts from)")
        sab = c.get("saved_activation_bytes")
        _need(sab is None or _is_int(sab), here, f"saved_activation_bytes is {sab!r}, not an integer")
        _need(c.get("bp") is None or isinstance(c["bp"], dict), here, "its bp entry is not an object")
        _need(c.get("last") is None or isinstance(c["last"], bool), here, f"last is {c.get('last')!r}, not true or false")
        return cls(index=idx, layers=(layers[0], layers[1]), lora_init=c["lora_init"], first_input=c.get("first_input"),
                   program=c.get("program"), weights=c.get("weights"), eager_weights=c.get("eager_weights"),
                   saved_activation_bytes=sab, last=c.get("last"), has_bp=c.get("bp") is not None, json=c)

    def for_mode(self, mode: str) -> "ChunkEntry":
        """The entry with program, weights and methods of the given mode: "zerolock" (the entry
        itself) or "bp" (the entry with its "bp" object's fields laid over it)."""
        if mode == "bp":
            if not self.has_bp:
                raise ManifestError(f"chunk {self.index} has no BP program: {FIX} --mode bp or both")
            return ChunkEntry.from_json({**self.json, **self.json["bp"]})
        if mode == "zerolock":
            if self.program is None:
                raise ManifestError(f"chunk {self.index} has no ZeroLock program (a --mode bp export): "
                                    f"{FIX} --mode zerolock or both")
            return self
        raise ValueError(f"unknown mode {mode!r}: use one of {MODES}")

    def for_schedule(self, schedule: str) -> "ChunkEntry":
        """The entry of the program `schedule` runs (program_mode)."""
        return self.for_mode(program_mode(schedule))


@dataclass(frozen=True)
class Manifest:
    """manifest.json of an export: its chunks, its files by path, and the export settings
    (ExportConfig.to_json), the model and the LoRA as written."""
    chunks: tuple[ChunkEntry, ...]
    files: dict[str, FileEntry]
    export: dict
    model: dict
    lora: dict | None
    json: dict = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, m, where: str = MANIFEST) -> "Manifest":
        """The manifest's records, checked to be of the types the readers take; a ManifestError
        (one line) names the first that is not. Format and version are load's to check."""
        _need(isinstance(m, dict), where, f"holds {type(m).__name__}, not an object")
        chunks, files = m.get("chunks"), m.get("files")
        _need(isinstance(chunks, list), where, "has no chunks list")
        _need(isinstance(files, list), where, "has no files list")
        for key in ("export", "model"):
            _need(isinstance(m.get(key, {}), dict), where, f"its {key} is not an object")
        _need("export" in m, where, "has no export (the settings it was exported with)")
        entries = tuple(ChunkEntry.from_json(c, where) for c in chunks)
        by_path = {}
        for f in files:
            ok = (isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("sha256"), str)
                  and _is_int(f.get("size")))
            _need(ok, where, f"a files entry is {str(f)[:80]}, not {{path, sha256, size}}")
            by_path[f["path"]] = FileEntry(f["path"], f["sha256"], f["size"])
        return cls(chunks=entries, files=by_path, export=m["export"], model=m.get("model", {}), lora=m.get("lora"),
                   json=m)

    @classmethod
    def load(cls, root: Path, check_files: bool = True) -> "Manifest":
        """An export directory's manifest (read_manifest), with its records checked."""
        m = cls.from_json(read_manifest(root, check_files=False), str(Path(root) / MANIFEST))
        if check_files:  # after the records are checked, so a malformed files list is named, not a KeyError
            _check_files(Path(root), ((f.path, f.size, f.sha256) for f in m.files.values()))
        return m


def read_manifest(root: Path, check_files: bool = True) -> dict:
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
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ManifestError(f"{path} is not a ZeroLock export manifest: {fix}")
    if m.get("format_version") != FORMAT_VERSION:
        raise ManifestError(f"{path} has format version {m.get('format_version')}, this tool reads "
                            f"{FORMAT_VERSION}: re-export with this version of zl-export")
    if check_files:
        _check_files(root, ((f["path"], f["size"], f["sha256"]) for f in m["files"]))
    return m


def _check_files(root: Path, files) -> None:
    """Every (path, size, sha256) exists under root with that size and sha256."""
    for path, size, sha in files:
        p = root / path
        if not p.is_file():
            raise ManifestError(f"{p} listed in the manifest is missing: re-export, or copy the whole directory")
        if p.stat().st_size != size or sha256_file(p) != sha:
            raise ManifestError(f"{p} does not match its sha256 in the manifest (corrupt or changed): re-export it")
