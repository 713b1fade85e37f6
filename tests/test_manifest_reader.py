"""zl_common.manifest: manifest.json read as typed records, the BP entry chosen in one place, and
a malformed manifest named in one line (by the host's loader and by a phone given one)."""
from __future__ import annotations

import hashlib
import json

import pytest

from zl_common.manifest import FORMAT, FORMAT_VERSION, Manifest, ManifestError, program_mode


def _chunk(k: int, last: bool, zerolock: bool = True, bp: bool = True) -> dict:
    c = {"index": k, "layers": [k, k], "lora_init": f"chunk_{k}_lora_init.safetensors",
         "lora": [{"name": "a", "shape": [4, 8], "dtype": "float32"}], "eager_weights": f"chunk_{k}_weights.safetensors"}
    if zerolock:
        c.update(first_input="input_ids" if k == 0 else "h_in", program=f"chunk_{k}.pte", weights=f"chunk_{k}.ptd",
                 methods={"phase1": {"inputs": []}}, saved_activation_bytes=100 + k)
    if bp:
        c["bp"] = {"first_input": "input_ids" if k == 0 else "h_in", "last": last, "program": f"chunk_{k}_bp.pte",
                   "weights": f"chunk_{k}.ptd", "methods": {"phase1": {"inputs": [{"name": "bp"}]}},
                   "saved_activation_bytes": 200 + k}
    return c


def _manifest(**chunk_kw) -> dict:
    chunks = [_chunk(k, k == 1, **chunk_kw) for k in range(2)]
    names = sorted({v for c in chunks for d in (c, c.get("bp", {})) for key, v in d.items()
                    if key in ("program", "weights", "lora_init", "eager_weights")})
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "modes": ["zerolock", "bp"],
            "model": {"source": "tiny"}, "export": {"alpha": 0.5, "readout_rows": 0}, "chunks": chunks,
            "files": [{"path": n, "sha256": "0" * 64, "size": 1} for n in names]}


def test_the_records_and_the_bp_entry():
    m = Manifest.from_json(_manifest())
    c = m.chunks[1]
    assert (c.index, c.layers, c.program, c.weights, c.first_input) == (1, (1, 1), "chunk_1.pte", "chunk_1.ptd", "h_in")
    assert c.saved_activation_bytes == 101 and c.has_bp and c.last is None
    assert m.files["chunk_1.pte"].size == 1 and m.export["alpha"] == 0.5
    assert c.for_mode("zerolock") is c
    bp = c.for_mode("bp")
    # the BP object's fields laid over the entry; what is not in it (lora_init, lora) kept
    assert (bp.program, bp.weights, bp.last, bp.saved_activation_bytes) == ("chunk_1_bp.pte", "chunk_1.ptd", True, 201)
    assert bp.lora_init == c.lora_init and bp.json["lora"] is c.json["lora"]
    assert bp.json["methods"] is c.json["bp"]["methods"]  # what ChunkProgram reads
    assert bp.for_mode("bp") == bp  # a BP entry stays one (the stage picks again what the device picked)
    assert c.for_schedule("zerolock") is c and c.for_schedule("1f1b") == bp
    assert [program_mode(s) for s in ("zerolock", "gpipe", "1f1b", "zerobubble")] == ["zerolock", "bp", "bp", "bp"]
    with pytest.raises(ValueError, match="unknown mode"):
        c.for_mode("pipedream")


def test_a_missing_mode_is_one_line_naming_the_export_to_make():
    zl_only = Manifest.from_json(_manifest(bp=False)).chunks[0]
    with pytest.raises(ManifestError) as e:
        zl_only.for_schedule("gpipe")
    assert str(e.value) == "chunk 0 has no BP program: re-export with zl-export --mode bp or both"
    bp_only = Manifest.from_json(_manifest(zerolock=False)).chunks[1]
    assert bp_only.program is None and bp_only.for_mode("bp").program == "chunk_1_bp.pte"
    with pytest.raises(ManifestError, match="chunk 1 has no ZeroLock program .*--mode zerolock or both"):
        bp_only.for_schedule("zerolock")


def _break(m: dict, how) -> dict:
    how(m)
    return m


@pytest.mark.parametrize("how, words", [
    (lambda m: m.pop("chunks"), "has no chunks list"),
    (lambda m: m.update(files={}), "has no files list"),
    (lambda m: m.pop("export"), "has no export"),
    (lambda m: m.update(model=[]), "its model is not an object"),
    (lambda m: m["chunks"].__setitem__(1, "chunk_1"), "a chunk entry is str"),
    (lambda m: m["chunks"][1].update(index="1"), "index is '1'"),
    (lambda m: m["chunks"][1].update(layers="1-1"), "chunk 1: layers is '1-1', not [first, last]"),
    (lambda m: m["chunks"][1].update(program=7), "chunk 1: program is 7, not a name"),
    (lambda m: m["chunks"][0].pop("lora_init"), "chunk 0: has no lora_init"),
    (lambda m: m["chunks"][0].update(bp=[]), "chunk 0: its bp entry is not an object"),
    (lambda m: m["chunks"][0]["bp"].update(last="no"), None),  # read when the BP entry is taken
    (lambda m: m["files"].append({"path": "x"}), "a files entry is {'path': 'x'}"),
])
def test_a_malformed_manifest_is_one_line(how, words):
    m = _break(_manifest(), how)
    if words is None:
        with pytest.raises(ManifestError, match="last is 'no', not true or false"):
            Manifest.from_json(m).chunks[0].for_mode("bp")
        return
    with pytest.raises(ManifestError) as e:
        Manifest.from_json(m)
    msg = str(e.value)
    assert "\n" not in msg and words in msg and msg.startswith("manifest.json: ") and msg.endswith("re-export with zl-export")


def test_load_checks_format_and_files(tmp_path):
    m = _manifest()
    for f in m["files"]:
        (tmp_path / f["path"]).write_bytes(b"x")
    for f in m["files"]:
        f["sha256"] = hashlib.sha256(b"x").hexdigest()
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    assert Manifest.load(tmp_path).chunks[1].for_mode("bp").program == "chunk_1_bp.pte"
    (tmp_path / "chunk_1_bp.pte").write_bytes(b"y")
    with pytest.raises(ManifestError, match="chunk_1_bp.pte does not match its sha256"):
        Manifest.load(tmp_path)
    assert Manifest.load(tmp_path, check_files=False).chunks[0].index == 0
    (tmp_path / "manifest.json").write_text(json.dumps({**m, "files": [*m["files"], {"path": "x"}]}))
    with pytest.raises(ManifestError, match="a files entry is"):  # named before the files are looked at
        Manifest.load(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps([m]))
    with pytest.raises(ManifestError, match="is not a ZeroLock export manifest"):
        Manifest.load(tmp_path)
    m["chunks"][0]["layers"] = [0]
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ManifestError, match=r"manifest.json: chunk 0: layers is \[0\]"):
        Manifest.load(tmp_path, check_files=False)


def test_a_phone_refuses_a_malformed_manifest_in_one_line(tmp_path):
    """REJECTED with the line, before any file is looked at (was: INTERNAL, a KeyError)."""
    from zl_mobile.backends import Backend
    from zl_mobile.device import Device
    from zl_mobile.protocol import Message, MsgType, ProtocolError, new_token

    device = Device("malformed", tmp_path / "phone", new_token(), backend=Backend.from_args("eager"))
    meta = {"request_id": 7, "run_id": "r", "stage": 1, "num_stages": 2, "upstream_token": new_token(),
            "program_sha256": "0" * 64}
    for how, words in ((lambda m: m.pop("files"), "manifest.json: has no files list"),
                       (lambda m: m["chunks"][1].update(lora_init=None), "chunk 1: has no lora_init")):
        (device.files / "manifest.json").write_text(json.dumps(_break(_manifest(), how)))
        with pytest.raises(ProtocolError) as e:
            device.handle(Message(MsgType.STAGE_ASSIGN, meta))
        assert e.value.code.value == "REJECTED" and "\n" not in e.value.message
        assert words in e.value.message and "push the export's own manifest.json" in e.value.message
    # a BP schedule on an export without BP programs: refused by the same rule, in one line
    (device.files / "manifest.json").write_text(json.dumps(_manifest(bp=False)))
    with pytest.raises(ProtocolError) as e:
        device.handle(Message(MsgType.STAGE_ASSIGN, {**meta, "schedule": "gpipe"}))
    assert e.value.code.value == "REJECTED"
    assert e.value.message == "schedule gpipe: chunk 1 has no BP program: re-export with zl-export --mode bp or both"


def _export_on_disk(root, m: dict):
    """m written as an export directory whose listed files exist with the recorded sha256."""
    root.mkdir()
    for f in m["files"]:
        (root / f["path"]).write_bytes(b"x")
        f["sha256"] = hashlib.sha256(b"x").hexdigest()
    (root / "manifest.json").write_text(json.dumps(m))
    return root


def test_the_coordinator_takes_each_chunks_entry_for_the_schedule(tmp_path):
    """The devices are weighed by the program each runs (a BP stage by its BP activations), and an
    export without the schedule's programs is refused in one line before any phone is touched."""
    from host.run.coordinator import Coordinator, DeviceHandle, RunError
    from host.run.settings import RunSettings

    m = _manifest()
    m["chunks"][0]["bp"]["saved_activation_bytes"] = 1000  # chunk 0's BP stage holds the most; chunk 1's ZeroLock one
    export = _export_on_disk(tmp_path / "export", m)
    big, small = DeviceHandle("big", "127.0.0.1:1", "t", memory_bytes=2 << 30), DeviceHandle("small", "127.0.0.1:2", "t", 1 << 30)
    for schedule, order in (("zerolock", ["small", "big"]), ("gpipe", ["big", "small"])):
        co = Coordinator(export, [small, big], [], RunSettings(schedule=schedule), tmp_path / f"run-{schedule}")
        co.metrics.close()
        assert [st.device.name for st in co.stages] == order
        assert [e.program for e in co.entries] == (["chunk_0.pte", "chunk_1.pte"] if schedule == "zerolock"
                                                   else ["chunk_0_bp.pte", "chunk_1_bp.pte"])
    for bp, schedule, words in ((False, "1f1b", "chunk 0 has no BP program"),
                                (True, "zerolock", "chunk 0 has no ZeroLock program")):
        export = _export_on_disk(tmp_path / f"export-{schedule}", _manifest(zerolock=not bp, bp=bp))
        with pytest.raises(RunError) as e:
            Coordinator(export, [small, big], [], RunSettings(schedule=schedule), tmp_path / "refused")
        assert str(e.value).startswith(f"schedule {schedule}: {words}") and "\n" not in str(e.value)
        assert not (tmp_path / "refused" / "metrics.jsonl").exists()


def test_the_least_memory_a_phone_needs_is_that_of_the_schedules_program(tmp_path):
    """`--devices auto` passes over phones with less (host.devices.problems): the floor is weighed as
    the coordinator weighs the chunks, and an export without the schedule's programs sets none."""
    from host.devices.problems import min_chunk_bytes

    m = _manifest()
    m["chunks"][0]["bp"]["saved_activation_bytes"] = 1000
    export = _export_on_disk(tmp_path / "export", m)  # every file 1 byte
    assert min_chunk_bytes(export, m) == 1 + 100
    assert min_chunk_bytes(export, m, "1f1b") == 1 + 201
    assert min_chunk_bytes(export, _manifest(bp=False), "gpipe") == 0
