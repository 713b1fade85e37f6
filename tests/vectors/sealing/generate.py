#!/usr/bin/env python3
"""Sealed-session vectors (docs/PROTOCOL.md 6.1), run by tests/test_sealing.py and the Kotlin
SealingVectorsTest: keys from a token, nonces and fixed X25519 keys; frames sealed at given
counters; tampered frames and the error each gets.

    python tests/vectors/sealing/generate.py          # rewrite vectors.json
    python tests/vectors/sealing/generate.py --check  # exit 1 if it differs
"""
from __future__ import annotations

import hashlib
import json
import struct
import sys
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from zl_mobile.protocol import seal as S  # noqa: E402
from zl_mobile.protocol.frames import SEALED_FLAG, encode_header  # noqa: E402

HERE = Path(__file__).resolve().parent
VEC = HERE.parent
OUT = HERE / "vectors.json"

TOKEN = bytes(range(32))
HOST_NONCE = hashlib.sha256(b"zerolock test host nonce").digest()
DEVICE_NONCE = hashlib.sha256(b"zerolock test device nonce").digest()
# fixed ephemeral keys (in a session they are fresh per handshake)
HOST_PRIVATE = hashlib.sha256(b"zerolock test host x25519").digest()
DEVICE_PRIVATE = hashlib.sha256(b"zerolock test device x25519").digest()


def seal_frame(key: bytes, counter: int, plain_frame: bytes) -> bytes:
    """A plain frame's body sealed: the header says SEALED_FLAG and body_len + 16."""
    mtype, body = plain_frame[5], plain_frame[16:-4]
    header = encode_header(mtype, len(body) + S.TAG_BYTES, flags=SEALED_FLAG)
    sealed = S.Seal(key, key, sent=counter).seal(header, body)
    return header + sealed + struct.pack("<I", zlib.crc32(sealed))


def fix_crcs(frame: bytearray) -> bytes:
    """What an on-path attacker does after editing a frame: the CRCs match again."""
    frame[12:16] = struct.pack("<I", zlib.crc32(bytes(frame[:12])))
    frame[-4:] = struct.pack("<I", zlib.crc32(bytes(frame[16:-4])))
    return bytes(frame)


def build() -> dict:
    hp, dp = S.private_from_bytes(HOST_PRIVATE), S.private_from_bytes(DEVICE_PRIVATE)
    ph, pd = S.public_share(hp), S.public_share(dp)
    dh = S.shared_secret(hp, pd)
    assert dh == S.shared_secret(dp, ph)
    h2d, d2h = S.derive_keys(TOKEN, HOST_NONCE, DEVICE_NONCE, dh, ph, pd)
    frames = []
    # (name, plain vector, direction, counter): the plain frames are the section 9 vectors
    for name, plain, direction, counter in [("hello", "hello", "d2h", 0), ("heartbeat", "heartbeat", "h2d", 0),
                                            ("hidden_state", "hidden_state", "h2d", 1),
                                            ("state_put_lora", "state_put_lora", "d2h", 7)]:
        raw = (VEC / f"{plain}.bin").read_bytes()
        key = h2d if direction == "h2d" else d2h
        frames.append({"name": name, "plain_vector": plain, "direction": direction, "counter": counter,
                       "sealed_hex": seal_frame(key, counter, raw).hex()})
    hs = bytes.fromhex(frames[2]["sealed_hex"])  # HIDDEN_STATE, h2d counter 1
    tampered = []

    def t(name: str, data: bytes, counter: int, error: str, why: str):
        tampered.append({"name": name, "direction": "h2d", "counter": counter, "sealed_hex": data.hex(),
                         "error": error, "why": why})

    flip = bytearray(hs)
    flip[16 + 40] ^= 0x01
    t("body_bit_flipped", fix_crcs(flip), 1, "UNAUTHENTICATED", "one ciphertext bit flipped, CRCs fixed")
    retype = bytearray(hs)
    retype[5] = 0x31  # HIDDEN_STATE -> GRADIENT
    t("header_type_changed", fix_crcs(retype), 1, "UNAUTHENTICATED", "the header is associated data")
    tag = bytearray(hs)
    tag[-5] ^= 0x80
    t("tag_changed", fix_crcs(tag), 1, "UNAUTHENTICATED", "last tag byte changed, CRCs fixed")
    t("replayed", hs, 2, "UNAUTHENTICATED", "frame #1 received again where #2 is due")
    t("dropped", hs, 0, "UNAUTHENTICATED", "frame #1 arrives where #0 is due: #0 was dropped")
    t("wrong_direction", bytes.fromhex(seal_frame(d2h, 1, (VEC / "hidden_state.bin").read_bytes()).hex()), 1,
      "UNAUTHENTICATED", "sealed with the other direction's key (reflected back)")
    unflag = bytearray(hs)
    unflag[6] = 0
    t("flags_clear", fix_crcs(unflag), 1, "MALFORMED", "a sealed connection takes only sealed frames")
    plain = (VEC / "heartbeat.bin").read_bytes()
    t("plain_frame", plain, 1, "MALFORMED", "an unsealed frame after the handshake (a version-1 peer)")
    crc = bytearray(hs)
    crc[-1] ^= 0xFF
    t("body_crc_wrong", bytes(crc), 1, "BAD_CHECKSUM", "the CRC still catches line noise first")
    return {
        "description": "PROTOCOL.md 6.1: keys = HKDF-SHA256(salt Nh||Nd, IKM token||X25519(dh), info label||Ph||Pd); "
                       "frames: AES-256-GCM, nonce 00000000||u64le counter, AAD the 16 header bytes",
        "token": TOKEN.hex(), "host_nonce": HOST_NONCE.hex(), "device_nonce": DEVICE_NONCE.hex(),
        "host_private": HOST_PRIVATE.hex(), "device_private": DEVICE_PRIVATE.hex(),
        "host_share": ph.hex(), "device_share": pd.hex(), "dh": dh.hex(),
        "info_h2d_hex": S.INFO_H2D.hex(), "info_d2h_hex": S.INFO_D2H.hex(),
        "key_h2d": h2d.hex(), "key_d2h": d2h.hex(),
        "nonce_of_counter_7": S.nonce(7).hex(),
        "frames": frames, "tampered": tampered,
    }


def render() -> str:
    return json.dumps(build(), indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":
    if "--check" in sys.argv:
        ok = OUT.exists() and OUT.read_text() == render()
        print("up to date" if ok else f"{OUT} is stale: run python tests/vectors/sealing/generate.py")
        sys.exit(0 if ok else 1)
    OUT.write_text(render())
    print(f"wrote {OUT}")
