"""Record layer of protocol version 2 (PROTOCOL.md 6.1): after the handshake every frame is sealed
with AES-256-GCM, one key per direction, a 64-bit counter nonce per direction, the frame header as
associated data. The primitives are `cryptography`'s (OpenSSL); nothing here is a cipher.

The seal of a connection is registered against its socket (`install`), so send_message /
recv_message seal and open every frame on it whatever code path sends or reads: no call site can
forget. ZL_BENCHMARK_ONLY_UNSEALED=1 (both ends) skips the install, for bench/sealing.py alone.
"""
from __future__ import annotations

import os
import struct
import threading
import weakref

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import ErrorCode, ProtocolError

TAG_BYTES = 16
KEY_BYTES = 32
SHARE_BYTES = 32
INFO_H2D = b"ZLWP2 seal host->device\x00"
INFO_D2H = b"ZLWP2 seal device->host\x00"
MAX_COUNTER = (1 << 64) - 1
BENCH_ENV = "ZL_BENCHMARK_ONLY_UNSEALED"


def sealing_disabled_for_benchmark() -> bool:
    """bench/sealing.py's switch: never set it outside a throughput comparison."""
    return os.environ.get(BENCH_ENV) == "1"


# ---- key exchange and derivation ------------------------------------------------------------

def new_share() -> tuple[X25519PrivateKey, bytes]:
    """An ephemeral X25519 key pair for one handshake: (private key, 32-byte public share)."""
    priv = X25519PrivateKey.generate()
    return priv, public_share(priv)


def public_share(priv: X25519PrivateKey) -> bytes:
    return priv.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def private_from_bytes(raw: bytes) -> X25519PrivateKey:
    return X25519PrivateKey.from_private_bytes(raw)


def shared_secret(priv: X25519PrivateKey, peer_share: bytes) -> bytes:
    if len(peer_share) != SHARE_BYTES:
        raise ProtocolError(ErrorCode.UNAUTHENTICATED, "key share must be 32 bytes")
    try:
        return priv.exchange(X25519PublicKey.from_public_bytes(peer_share))
    except ValueError:  # a low-order point gives the all-zero secret: refused by OpenSSL
        raise ProtocolError(ErrorCode.UNAUTHENTICATED, "peer's key share is a low-order point; refused") from None


def derive_keys(token: bytes, host_nonce: bytes, device_nonce: bytes, dh: bytes,
                host_share: bytes, device_share: bytes) -> tuple[bytes, bytes]:
    """(host->device key, device->host key). HKDF-SHA256: salt Nh||Nd, IKM token||DH, info the
    direction's label || Ph || Pd. The token keeps a man in the middle out (he has no token); the
    DH secret keeps a later-leaked token from opening a recorded session (forward secrecy)."""
    ikm = token + dh

    def one(label: bytes) -> bytes:
        return HKDF(hashes.SHA256(), KEY_BYTES, salt=host_nonce + device_nonce,
                    info=label + host_share + device_share).derive(ikm)

    return one(INFO_H2D), one(INFO_D2H)


def nonce(counter: int) -> bytes:
    """12-byte GCM nonce: 4 zero bytes, then the frame counter as u64 little-endian."""
    return b"\x00\x00\x00\x00" + struct.pack("<Q", counter)


# ---- one connection's record layer ----------------------------------------------------------

class Seal:
    """Both directions of one connection. Callers serialise sends (Connection's lock) and reads
    (one reader), so counter order is wire order."""

    def __init__(self, send_key: bytes, recv_key: bytes, sent: int = 0, received: int = 0):
        self._send, self._recv = AESGCM(send_key), AESGCM(recv_key)
        self.sent = sent          # counter of the next frame sent (a start other than 0: test vectors)
        self.received = received  # counter of the next frame expected
        self._lock = threading.Lock()

    def seal(self, header: bytes, body: bytes, out=None) -> bytes:
        """Ciphertext || tag; with `out` (len(body) + 16 bytes, e.g. a view into the frame being
        built) written there instead of into a new buffer: one copy less per frame."""
        with self._lock:
            n = self.sent
            if n > MAX_COUNTER:
                raise ProtocolError(ErrorCode.INTERNAL, "2^64 frames sent on one connection; reconnect")
            self.sent = n + 1
        if out is None:
            return self._send.encrypt(nonce(n), body, header)
        self._send.encrypt_into(nonce(n), body, header, out)
        return out

    def open(self, header: bytes, sealed, what: str) -> bytearray:
        """The plaintext, in a new writable buffer (received tensors view it, as they view a plain
        frame's body)."""
        n = self.received
        plain = bytearray(len(sealed) - TAG_BYTES)
        try:
            self._recv.decrypt_into(nonce(n), sealed, header, plain)
        except InvalidTag:
            raise ProtocolError(ErrorCode.UNAUTHENTICATED,
                                f"sealed {what} frame #{n} failed to open (altered, replayed, dropped or reordered "
                                "in transit, or a different key); nothing in it was used, the connection ends") from None
        self.received = n + 1
        return plain


_SEALS: "weakref.WeakKeyDictionary[object, Seal]" = weakref.WeakKeyDictionary()


def install(sock, seal: Seal | None) -> None:
    """From now on every frame on `sock` is sealed/opened with `seal` (None: the benchmark switch)."""
    if seal is not None:
        _SEALS[sock] = seal


def seal_of(sock) -> Seal | None:
    try:
        return _SEALS.get(sock)
    except TypeError:  # not weak-referenceable (a test's stand-in for a socket): never sealed
        return None
