#!/usr/bin/env python3
"""Write the tricky-frame fuzz seeds: tests/fuzz_corpus/<EXPECT>__<name>.bin, where EXPECT is
`valid` or the ProtocolError code decoding must raise (max_frame = default). Deterministic;
tests/test_protocol_fuzz.py checks the files match and uses them as seeds for mutation."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("zl_vectors_generate", HERE.parent / "vectors" / "generate.py")
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)

import numpy as np  # noqa: E402

from zl_mobile.protocol import Message, MsgType, encode_message  # noqa: E402
from zl_mobile.protocol.frames import encode_header  # noqa: E402


def nested(depth: int) -> bytes:
    """A metadata object whose nesting depth is exactly `depth` (top-level object = 1)."""
    return b'{"seq":1,"x":' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


def build() -> dict[str, bytes]:
    H, HS, SP = int(MsgType.HEARTBEAT), int(MsgType.HIDDEN_STATE), int(MsgType.STATE_PUT)
    f = gen.frame
    b = gen.body
    sp_meta = gen.meta_bytes({"request_id": 1, "kind": "lora"})
    hs_meta = gen.meta_bytes({"micro_batch": 0, "window": 0})
    many = {f"t{i}": np.zeros((0,), dtype=np.float32) for i in range(1000)}
    corpus = {
        "valid__depth_32": f(H, b(nested(32))),
        "MALFORMED__depth_33": f(H, b(nested(33))),
        "MALFORMED__depth_5000": f(H, b(nested(5000))),
        "MALFORMED__int_5000_digits": f(H, b(b'{"seq":' + b"9" * 5000 + b"}")),
        "valid__surrogate_pair": f(H, b(b'{"seq":1,"x":"\\ud83d\\ude00"}')),
        "MALFORMED__bom": f(H, b(b'\xef\xbb\xbf{"seq":1}')),
        "MALFORMED__control_char_in_string": f(H, b(b'{"seq":1,"x":"a\x01"}')),
        "valid__whitespace_json": f(H, b(b' \n{ "seq" : 1 }\t')),
        "MALFORMED__two_json_values": f(H, b(b'{"seq":1}{}')),
        "MALFORMED__body_len_0": f(H, b""),
        "OVERSIZED__body_len_max": encode_header(H, 0xFFFFFFFF),
        "TRUNCATED__body_len_1000_no_body": encode_header(H, 1000),
        "valid__1000_empty_tensors": encode_message(Message(MsgType.STATE_PUT, {"request_id": 1, "kind": "lora"},
                                                            many)),
        "valid__ndim_8_and_scalar": encode_message(Message(MsgType.STATE_PUT, {"request_id": 1, "kind": "lora"}, {
            "n" * 1024: np.ones((1, 2, 1, 2, 1, 2, 1, 2), dtype=np.int32), "s": np.array(True)})),
        "valid__empty_dims_just_below_limit": f(SP, b(sp_meta, gen.record(
            "e", 2, [0, 0xFFFF, 0xFFFF], b"", offset=4 + len(sp_meta) + 2), 1)),
        "MALFORMED__name_1025_bytes": f(SP, b(sp_meta, gen.record(
            "n" * 1025, 6, [1], b"\0", offset=4 + len(sp_meta) + 2), 1)),
        "MALFORMED__name_invalid_utf8": f(SP, b(sp_meta, gen.record(
            "x", 6, [], b"\0", offset=4 + len(sp_meta) + 2).replace(b"x", b"\xff", 1), 1)),
        "MALFORMED__nbytes_4GiB_claim": f(HS, b(hs_meta, gen.record(
            "h", 6, [0xFFFFFFFF], b"", offset=4 + len(hs_meta) + 2, nbytes=0xFFFFFFFF), 1)),
        "MALFORMED__hidden_state_h_only_in_meta": f(HS, b(gen.meta_bytes({"micro_batch": 0, "window": 0,
                                                                          "h": [1.0]}))),
    }
    return {f"{k}.bin": v for k, v in corpus.items()}


def main(argv) -> int:
    files = build()
    if "--check" in argv:
        bad = [n for n, c in files.items() if not (HERE / n).is_file() or (HERE / n).read_bytes() != c]
        print("stale:", bad) if bad else print("corpus up to date")
        return 1 if bad else 0
    for p in HERE.glob("*.bin"):
        if p.name not in files:
            p.unlink()
    for n, c in files.items():
        (HERE / n).write_bytes(c)
    print(json.dumps(sorted(files)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
