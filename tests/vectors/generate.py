#!/usr/bin/env python3
"""Regenerate the protocol test vectors (docs/PROTOCOL.md section 9) from the Python implementation.

    python tests/vectors/generate.py          # rewrite tests/vectors/*.bin|*.json
    python tests/vectors/generate.py --check  # exit 1 if the committed files differ

Deterministic: fixed seeds and fixed nonces. tests/test_protocol.py runs the --check logic.
"""
from __future__ import annotations

import hashlib
import json
import struct
import sys
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zl_mobile.protocol import (  # noqa: E402
    DEFAULT_MAX_FRAME,
    Message,
    MsgType,
    bf16_from_float32,
    device_proof,
    encode_message,
    host_proof,
)
from zl_mobile.protocol.frames import HEADER_SIZE, encode_header  # noqa: E402
from zl_mobile.protocol.handshake import DEVICE_LABEL, HOST_LABEL  # noqa: E402
from zl_mobile.protocol.tensors import as_wire_array, to_float_values  # noqa: E402

HERE = Path(__file__).resolve().parent
# written by hand, not from frames: the quoting rule of PROTOCOL.md 7, which both phones run
HAND_WRITTEN = {"quoting.json"}

TOKEN = bytes(range(32))
HOST_NONCE = hashlib.sha256(b"zerolock test host nonce").digest()
DEVICE_NONCE = hashlib.sha256(b"zerolock test device nonce").digest()


def sha(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


# ---- building blocks for hand-made (mostly invalid) frames ------------------------------------

def meta_bytes(meta) -> bytes:
    return json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def body(meta_raw: bytes, records: bytes = b"", count: int = 0) -> bytes:
    return struct.pack("<I", len(meta_raw)) + meta_raw + struct.pack("<H", count) + records


def frame(msg_type: int, body_bytes: bytes, *, version: int = 1, flags: int = 0) -> bytes:
    """A frame with correct header and body CRCs around arbitrary body bytes."""
    return (encode_header(msg_type, len(body_bytes), version=version, flags=flags) + body_bytes
            + struct.pack("<I", zlib.crc32(body_bytes)))


def record(name: str, dtype: int, shape, data: bytes, *, offset: int, nbytes: int | None = None,
           crc: int | None = None, pad_byte: int = 0) -> bytes:
    """A raw tensor record starting at body offset `offset` (padding computed from it)."""
    nb = name.encode()
    head = (struct.pack("<H", len(nb)) + nb + struct.pack("<BB", dtype, len(shape))
            + struct.pack(f"<{len(shape)}I", *shape)
            + struct.pack("<II", len(data) if nbytes is None else nbytes,
                          zlib.crc32(data) if crc is None else crc))
    pad = (-(offset + len(head))) % 8
    return head + bytes([pad_byte]) * pad + data


def tensor_json(arr) -> dict:
    code, wire = as_wire_array(arr)
    values = to_float_values(arr).reshape(-1).tolist() if code.name in ("BFLOAT16",) \
        else np.asarray(wire).reshape(-1).tolist()
    if code.name in ("FLOAT32", "FLOAT16", "BFLOAT16"):
        values = [float(v) if np.isfinite(v) else ("NaN" if np.isnan(v) else ("Infinity" if v > 0 else "-Infinity"))
                  for v in values]
    return {"dtype": code.wire_name, "shape": list(wire.shape), "crc32": zlib.crc32(wire.tobytes()),
            "data_hex": wire.tobytes().hex(), "values": values}


# ---- the vectors ------------------------------------------------------------------------------

def valid_messages() -> list[tuple[str, str, Message]]:
    rng = np.random.default_rng(20240607)
    hp = host_proof(TOKEN, HOST_NONCE, DEVICE_NONCE).hex()
    dp = device_proof(TOKEN, HOST_NONCE, DEVICE_NONCE).hex()
    h = rng.standard_normal((2, 3, 8)).astype(np.float32)
    labels = rng.integers(0, 32000, size=(2, 3)).astype(np.int64)
    labels[0, 0] = -100
    mask = np.array([[False, True, True], [True, True, False]])
    lora_a = rng.standard_normal((4, 8)).astype(np.float32) * 0.01
    chunk = np.frombuffer(hashlib.sha256(b"chunk").digest() * 2 + b"tail", dtype=np.uint8)
    M = Message
    return [
        ("auth_request", "host opens the handshake (nonce from handshake.json)",
         M(MsgType.AUTH_REQUEST, {"protocol_version": 1, "host_nonce": HOST_NONCE.hex(), "host_name": "zl-host"})),
        ("auth_challenge", "device answers with its nonce",
         M(MsgType.AUTH_CHALLENGE, {"device_nonce": DEVICE_NONCE.hex(), "device_name": "pixel-7a"})),
        ("auth_response", "host proof = HMAC(token, 'ZLWP1 host' 00 Nh Nd)",
         M(MsgType.AUTH_RESPONSE, {"host_proof": hp})),
        ("auth_ok", "device proof = HMAC(token, 'ZLWP1 device' 00 Nh Nd)",
         M(MsgType.AUTH_OK, {"device_proof": dp})),
        ("hello", "device info after AUTH_OK, with an extra unknown key that must be kept",
         M(MsgType.HELLO, {"name": "Pixel 7a — bench", "protocol_version": 1, "runtime_version": "executorch 1.5.1",
                           "memory_bytes": 8 * 1024 ** 3, "capabilities": ["executorch", "xnnpack", "lora", "replay"],
                           "model": "Pixel 7a", "cores": 8, "memory_budget_bytes": 3 * 1024 ** 3,
                           "x_future_field": {"nested": [1, 2.5, None, True]}})),
        ("hello_budgeted", "an emulated phone held to 0.45 of one core (zl-phone --cpu-share)",
         M(MsgType.HELLO, {"name": "emu1", "protocol_version": 1, "runtime_version": "zl_mobile 0.1.0 (executorch)",
                           "memory_bytes": 24 * 1024 ** 3, "capabilities": ["executorch", "lora", "replay"],
                           "os": "linux-emulated", "cores": 2, "cpu_share": 0.45})),
        ("heartbeat", "heartbeat with sender clock", M(MsgType.HEARTBEAT, {"seq": 42, "time_ms": 1234567890123})),
        ("ack", "ACK of a request", M(MsgType.ACK, {"request_id": 7, "ok": True})),
        ("error", "ERROR with a request_id",
         M(MsgType.ERROR, {"code": "REJECTED", "message": "program sha256 mismatch; re-push the program",
                           "request_id": 9})),
        ("shutdown", "SHUTDOWN with an empty metadata object", M(MsgType.SHUTDOWN, {})),
        ("file_begin", "start of a program transfer",
         M(MsgType.FILE_BEGIN, {"transfer_id": 1, "name": "chunk_0.pte", "kind": "program", "size": 68,
                                "sha256": hashlib.sha256(chunk.tobytes()).hexdigest()})),
        ("file_chunk", "68 bytes of file data at offset 0 (tensor 'data' uint8 1-D)",
         M(MsgType.FILE_CHUNK, {"transfer_id": 1, "offset": 0}, {"data": chunk})),
        ("file_end", "end of transfer", M(MsgType.FILE_END, {"transfer_id": 1})),
        ("file_result", "device accepts the file",
         M(MsgType.FILE_RESULT, {"transfer_id": 1, "ok": True, "size": 68,
                                 "sha256": hashlib.sha256(chunk.tobytes()).hexdigest()})),
        ("file_result_reject", "device rejects a transfer; sha256 null",
         M(MsgType.FILE_RESULT, {"transfer_id": 2, "ok": False, "size": 10, "sha256": None,
                                 "message": "offset gap at 10"})),
        ("stage_assign", "stage 1 of 3 with the standard keys",
         M(MsgType.STAGE_ASSIGN, {"request_id": 3, "stage": 1, "num_stages": 3, "upstream": "10.0.0.2:7070",
                                  "downstream": "10.0.0.4:7070", "program_sha256": sha("program"),
                                  "weights_sha256": sha("weights"), "window_size": 8, "buffer_capacity": 16,
                                  "inflight_depth": 2, "replay_horizon": 32, "schedule": "zerolock",
                                  "run_id": "run-001", "listen_port": 7070, "upstream_token": sha("up"),
                                  "downstream_token": sha("down"), "config": {"alpha": 0.5, "lr": 0.0002}})),
        ("stage_assign_first", "stage 0: upstream null",
         M(MsgType.STAGE_ASSIGN, {"request_id": 4, "stage": 0, "num_stages": 1, "upstream": None,
                                  "downstream": None, "program_sha256": sha("program0")})),
        ("hidden_state", "h float32 + labels int64 + mask bool",
         M(MsgType.HIDDEN_STATE, {"micro_batch": 17, "window": 2}, {"h": h, "labels": labels, "mask": mask})),
        ("hidden_state_bf16", "h as bfloat16 bits + attention_mask uint8",
         M(MsgType.HIDDEN_STATE, {"micro_batch": 18, "window": 2},
           {"h": bf16_from_float32(h[:1, :2, :4]), "attention_mask": np.array([[1, 1]], dtype=np.uint8)})),
        ("gradient", "float16 gradient for BP baselines",
         M(MsgType.GRADIENT, {"micro_batch": 5, "window": 0},
           {"grad_h": rng.standard_normal((1, 2, 4)).astype(np.float16)})),
        ("credit", "two credits", M(MsgType.CREDIT, {"credits": 2, "micro_batch": 16})),
        ("replay_request", "replay micro-batches 10..14",
         M(MsgType.REPLAY_REQUEST, {"from_micro_batch": 10, "to_micro_batch": 14, "window": 1})),
        ("telemetry", "telemetry with standard and free keys, unicode, negative and big numbers",
         M(MsgType.TELEMETRY, {"stage": 1, "step": 40, "loss": 2.718281828459045, "pss_bytes": 734003200,
                               "temperature_c": 38.5, "active_s": 12.25, "wait_s": 0.5, "time_ms": 1700000000000,
                               "note": "température ok ✓", "delta": -3, "big": 9223372036854775807,
                               "tiny": 1e-300, "list": []})),
        ("telemetry_nonfinite", "telemetry of a diverging run: the NaN loss left out and named in nonfinite",
         M(MsgType.TELEMETRY, {"kind": "micro_batch", "stage": 2, "step": 3, "micro_batch": 7,
                               "nonfinite": ["loss", "task_loss"], "consis_loss": 0.25})),
        ("checkpoint_committed", "checkpoint of window 3",
         M(MsgType.CHECKPOINT_COMMITTED, {"window": 3, "step": 24, "sha256": sha("ckpt")})),
        ("state_get", "ask for the LoRA tensors", M(MsgType.STATE_GET, {"request_id": 11, "kind": "lora"})),
        ("state_put_lora", "LoRA tensors with dotted names",
         M(MsgType.STATE_PUT, {"request_id": 11, "kind": "lora", "window": 3, "step": 24},
           {"layers.0.self_attn.q_proj.lora_A": lora_a,
            "layers.0.self_attn.q_proj.lora_B": np.zeros((8, 4), dtype=np.float32)})),
        ("state_put_all_dtypes", "one tensor per dtype, a scalar and an empty tensor",
         M(MsgType.STATE_PUT, {"request_id": 12, "kind": "optimizer"},
           {"f32": np.array([1.0, -0.0, np.inf, 3.4028234663852886e38], dtype=np.float32),
            "f16": np.array([[0.5, -65504.0], [6e-08, 1.0]], dtype=np.float16),
            "bf16": bf16_from_float32([1.0, -2.5, 3.0e38]),
            "i64": np.array([-(2 ** 63), 2 ** 63 - 1, 0], dtype=np.int64),
            "i32": np.array([[-(2 ** 31)], [2 ** 31 - 1]], dtype=np.int32),
            "u8": np.array([0, 255, 7], dtype=np.uint8),
            "bool": np.array([True, False, True]),
            "step": np.array(24, dtype=np.int64),
            "empty": np.zeros((0, 4), dtype=np.float32),
            "empty_wide": np.zeros((0, 0xFFFF, 0xFFFF), dtype=np.float16)})),
        ("state_put_empty", "STATE_PUT with no tensors", M(MsgType.STATE_PUT, {"request_id": 13, "kind": "optimizer"})),
    ]


def invalid_frames() -> list[tuple[str, str, bytes, str, int]]:
    """(name, description, bytes, expected error code, max_frame)."""
    D = DEFAULT_MAX_FRAME
    hb = encode_message(Message(MsgType.HEARTBEAT, {"seq": 1}))
    hb_body = hb[HEADER_SIZE:-4]
    H = int(MsgType.HEARTBEAT)
    HS = int(MsgType.HIDDEN_STATE)
    hello_missing = meta_bytes({"name": "x", "protocol_version": 1, "runtime_version": "r", "memory_bytes": 1})
    hello_share_text = meta_bytes({"name": "x", "protocol_version": 1, "runtime_version": "r", "memory_bytes": 1,
                                   "capabilities": [], "cpu_share": "0.45"})
    hs_meta = meta_bytes({"micro_batch": 0, "window": 0})
    off = 4 + len(hs_meta) + 2
    f32 = np.array([1.0, 2.0], dtype=np.float32).tobytes()

    def hs_frame(records: bytes, count: int, tail: bytes = b"") -> bytes:
        return frame(HS, body(hs_meta, records, count) + tail)

    good_h = record("h", 1, [2], f32, offset=off)
    bad_crc = bytearray(hb)
    bad_crc[-1] ^= 0xFF
    bad_hcrc = bytearray(hb)
    bad_hcrc[12] ^= 0x01
    deep = ("[" * 40 + "]" * 40)
    return [
        ("truncated_header", "only 10 of the 16 header bytes", hb[:10], "TRUNCATED", D),
        ("truncated_body", "header promises more body than present", hb[:-6], "TRUNCATED", D),
        ("truncated_trailer", "body present, 2 of 4 trailer CRC bytes", hb[:-2], "TRUNCATED", D),
        ("empty", "zero bytes", b"", "TRUNCATED", D),
        ("oversized", "header claims a 3 GiB body; only the header is present", encode_header(H, 3 << 30),
         "OVERSIZED", D),
        ("oversized_small_limit", "valid 2-tensor frame, receiver limit 64 bytes",
         hs_frame(good_h, 1), "OVERSIZED", 64),
        ("bad_magic", "magic 'HTTP'", b"HTTP" + hb[4:], "BAD_MAGIC", D),
        ("bad_version", "version 9 with a correct header CRC", frame(H, hb_body, version=9), "BAD_VERSION", D),
        ("bad_header_checksum", "header CRC off by one bit", bytes(bad_hcrc), "BAD_CHECKSUM", D),
        ("bad_body_checksum", "body CRC trailer wrong", bytes(bad_crc), "BAD_CHECKSUM", D),
        ("bad_tensor_checksum", "tensor data CRC wrong (body CRC right)",
         hs_frame(record("h", 1, [2], f32, offset=off, crc=0x12345678), 1), "BAD_CHECKSUM", D),
        ("unknown_type", "type 0x7f", frame(0x7F, hb_body), "UNKNOWN_TYPE", D),
        ("flags_nonzero", "reserved flags set", frame(H, hb_body, flags=1), "MALFORMED", D),
        ("trailing_bytes", "one valid frame followed by 3 bytes", hb + b"abc", "MALFORMED", D),
        ("malformed_json", "metadata is not JSON", frame(H, body(b'{"seq":1')), "MALFORMED", D),
        ("meta_not_object", "metadata is a JSON array", frame(H, body(b"[1]")), "MALFORMED", D),
        ("meta_duplicate_key", "duplicate key", frame(H, body(b'{"seq":1,"seq":2}')), "MALFORMED", D),
        ("meta_nan", "NaN literal", frame(H, body(b'{"seq":1,"x":NaN}')), "MALFORMED", D),
        ("meta_float_overflow", "1e400 overflows a double", frame(H, body(b'{"seq":1,"x":1e400}')), "MALFORMED", D),
        ("meta_int_as_float", "integer field written as 1.0", frame(H, body(b'{"seq":1.0}')), "MALFORMED", D),
        ("meta_int_too_big", "integer beyond int64", frame(H, body(b'{"seq":9223372036854775808}')), "MALFORMED", D),
        ("meta_bool_as_int", "uint field given true", frame(H, body(b'{"seq":true}')), "MALFORMED", D),
        ("meta_invalid_utf8", "metadata bytes are not UTF-8", frame(H, body(b'{"seq":1,"x":"\xff"}')),
         "MALFORMED", D),
        ("meta_lone_surrogate", "\\ud800 escape (not a Unicode scalar value)",
         frame(H, body(b'{"seq":1,"x":"\\ud800"}')), "MALFORMED", D),
        ("meta_too_deep", "nesting depth 41 > 32", frame(H, body(b'{"seq":1,"x":' + deep.encode() + b"}")),
         "MALFORMED", D),
        ("meta_len_zero", "meta_len 0", frame(H, struct.pack("<IH", 0, 0)), "MALFORMED", D),
        ("meta_len_past_body", "meta_len larger than the body", frame(H, struct.pack("<I", 100) + b"{}"),
         "MALFORMED", D),
        ("missing_field", "HELLO without capabilities", frame(int(MsgType.HELLO), body(hello_missing)),
         "MALFORMED", D),
        ("hello_budget_negative", "HELLO memory_budget_bytes is not a uint",
         frame(int(MsgType.HELLO), body(meta_bytes({"name": "x", "protocol_version": 1, "runtime_version": "r",
                                                    "memory_bytes": 1, "capabilities": [],
                                                    "memory_budget_bytes": -1}))), "MALFORMED", D),
        ("hello_cpu_share_not_number", "HELLO cpu_share written as a string", frame(int(MsgType.HELLO),
                                                                                    body(hello_share_text)),
         "MALFORMED", D),
        ("hidden_state_without_h", "HIDDEN_STATE lacks tensor 'h'",
         hs_frame(record("x", 1, [2], f32, offset=off), 1), "MALFORMED", D),
        ("tensor_on_heartbeat", "HEARTBEAT carries a tensor",
         frame(H, body(b'{"seq":1}', record("x", 6, [1], b"\x01", offset=4 + 9 + 2), 1)), "MALFORMED", D),
        ("tensor_bad_dtype", "dtype code 99", hs_frame(record("h", 99, [2], f32, offset=off), 1), "MALFORMED", D),
        ("tensor_nbytes_mismatch", "nbytes 12 for shape [2] float32",
         hs_frame(record("h", 1, [2], f32 + b"\0" * 4, offset=off), 1), "MALFORMED", D),
        ("tensor_too_many_dims", "ndim 9", hs_frame(record("h", 1, [1] * 9, f32[:4], offset=off), 1),
         "MALFORMED", D),
        ("tensor_past_body", "tensor count 2, one record", hs_frame(good_h, 2), "MALFORMED", D),
        ("tensor_duplicate_name", "two tensors named h",
         hs_frame(good_h + record("h", 1, [2], f32, offset=off + len(good_h)), 2), "MALFORMED", D),
        ("tensor_bad_bool", "bool byte 2",
         hs_frame(good_h + record("mask", 7, [2], b"\x01\x02", offset=off + len(good_h)), 2), "MALFORMED", D),
        ("tensor_nonzero_padding", "padding byte 0xAA",
         hs_frame(record("h", 1, [2], f32, offset=off, pad_byte=0xAA), 1), "MALFORMED", D),
        ("tensor_empty_name", "name_len 0", hs_frame(record("", 1, [2], f32, offset=off), 1), "MALFORMED", D),
        ("tensor_huge_dims", "dims 4294967295^3 (product of non-zero dims >= 2^32); nbytes 8",
         hs_frame(record("h", 1, [0xFFFFFFFF] * 3, f32, offset=off), 1), "MALFORMED", D),
        ("tensor_empty_huge_dims", "dims [0, 65536, 65536], nbytes 0: product of non-zero dims = 2^32",
         hs_frame(record("h", 1, [0, 0x10000, 0x10000], b"", offset=off), 1), "MALFORMED", D),
        ("body_trailing_bytes", "4 stray bytes after the last tensor record",
         hs_frame(good_h, 1, b"\0\0\0\0"), "MALFORMED", D),
        ("file_name_traversal", "FILE_BEGIN name '../x.pte'",
         frame(int(MsgType.FILE_BEGIN), body(meta_bytes({"transfer_id": 1, "name": "../x.pte", "kind": "program",
                                                         "size": 1, "sha256": sha("x")}))), "MALFORMED", D),
        ("stage_out_of_range", "stage 3 of 3",
         frame(int(MsgType.STAGE_ASSIGN), body(meta_bytes({"request_id": 1, "stage": 3, "num_stages": 3,
                                                           "upstream": None, "downstream": None,
                                                           "program_sha256": sha("p")}))), "MALFORMED", D),
        ("telemetry_loss_not_number", "TELEMETRY loss written as a string (optional fields keep their types)",
         frame(int(MsgType.TELEMETRY), body(meta_bytes({"stage": 1, "loss": "2.5"}))), "MALFORMED", D),
        ("telemetry_nonfinite_not_list", "TELEMETRY nonfinite as a string, not a list of keys",
         frame(int(MsgType.TELEMETRY), body(meta_bytes({"stage": 1, "nonfinite": "loss"}))), "MALFORMED", D),
        ("telemetry_bytes_negative", "TELEMETRY bytes_in -1 (uint)",
         frame(int(MsgType.TELEMETRY), body(meta_bytes({"stage": 1, "bytes_in": -1}))), "MALFORMED", D),
        ("bad_hex64", "sha256 in upper case",
         frame(int(MsgType.CHECKPOINT_COMMITTED), body(meta_bytes({"window": 1, "step": 1,
                                                                   "sha256": sha("c").upper()}))), "MALFORMED", D),
    ]


def handshake_json() -> dict:
    hi = HOST_LABEL + HOST_NONCE + DEVICE_NONCE
    di = DEVICE_LABEL + HOST_NONCE + DEVICE_NONCE
    return {"description": "HMAC-SHA256 handshake proofs (PROTOCOL.md section 6); key = raw token bytes",
            "token": TOKEN.hex(), "host_nonce": HOST_NONCE.hex(), "device_nonce": DEVICE_NONCE.hex(),
            "host_input_hex": hi.hex(), "device_input_hex": di.hex(),
            "host_proof": host_proof(TOKEN, HOST_NONCE, DEVICE_NONCE).hex(),
            "device_proof": device_proof(TOKEN, HOST_NONCE, DEVICE_NONCE).hex(),
            "wrong_token": bytes(range(1, 33)).hex(),
            "host_proof_with_wrong_token": host_proof(bytes(range(1, 33)), HOST_NONCE, DEVICE_NONCE).hex()}


def dumps(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"


def build() -> dict[str, bytes]:
    """All vector files: file name -> exact content."""
    files: dict[str, bytes] = {}
    for name, desc, msg in valid_messages():
        files[f"{name}.bin"] = encode_message(msg)
        files[f"{name}.json"] = dumps({
            "description": desc, "valid": True, "max_frame": DEFAULT_MAX_FRAME,
            "type": msg.type.name, "type_code": int(msg.type), "meta": msg.meta,
            "tensors": {k: tensor_json(v) for k, v in msg.tensors.items()}}).encode()
    for name, desc, data, code, max_frame in invalid_frames():
        files[f"{name}.bin"] = data
        files[f"{name}.json"] = dumps({"description": desc, "valid": False, "max_frame": max_frame,
                                       "error": code}).encode()
    files["handshake.json"] = dumps(handshake_json()).encode()
    return files


def stale(files: dict[str, bytes]) -> list[str]:
    """Names whose committed content differs, plus committed vector files no longer generated."""
    out = [n for n, c in files.items() if not (HERE / n).is_file() or (HERE / n).read_bytes() != c]
    on_disk = {p.name for p in HERE.iterdir() if p.suffix in (".bin", ".json")} - HAND_WRITTEN
    return sorted(out + sorted(on_disk - files.keys()))


def main(argv: list[str]) -> int:
    files = build()
    if "--check" in argv:
        bad = stale(files)
        if bad:
            print("stale vectors (run python tests/vectors/generate.py):", ", ".join(bad))
            return 1
        print(f"{len(files)} vector files up to date")
        return 0
    for p in HERE.iterdir():
        if p.suffix in (".bin", ".json") and p.name not in files and p.name not in HAND_WRITTEN:
            p.unlink()
    for n, c in files.items():
        (HERE / n).write_bytes(c)
    print(f"wrote {len(files)} files to {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
