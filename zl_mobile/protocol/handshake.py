"""Challenge-response handshake (PROTOCOL.md section 6).

Device side: one `DeviceAuth` per device (token, one-session slot, remembered host nonces), one
`DeviceHandshake` per accepted connection. Host side: one `HostHandshake` per connection.
These are pure state machines (no I/O); `host_handshake` / `device_handshake` run them over a
blocking socket.
"""
from __future__ import annotations

import collections
import hashlib
import hmac
import secrets
import socket
import threading
import time
from typing import Callable

from . import seal as _seal
from .errors import ErrorCode, ProtocolError
from .frames import PREAUTH_MAX_FRAME, PROTOCOL_VERSION
from .messages import Message, MsgType, error_reply
from .transport import recv_message, send_message

NONCE_BYTES = 32
HOST_LABEL = b"ZLWP1 host\x00"
DEVICE_LABEL = b"ZLWP1 device\x00"
REMEMBERED_NONCES = 4096


def parse_token(token: bytes | str) -> bytes:
    """Pairing token as raw bytes: 32 raw bytes, or their 64-character hex form."""
    if isinstance(token, str):
        try:
            token = bytes.fromhex(token.strip())
        except ValueError:
            raise ValueError("pairing token must be 64 hex digits") from None
    if len(token) != 32:
        raise ValueError(f"pairing token must be 32 bytes (64 hex digits), got {len(token)} bytes")
    return bytes(token)


def new_token() -> str:
    """A fresh pairing token in its hex form."""
    return secrets.token_hex(32)


def host_proof(token: bytes | str, host_nonce: bytes, device_nonce: bytes) -> bytes:
    return hmac.new(parse_token(token), HOST_LABEL + host_nonce + device_nonce, hashlib.sha256).digest()


def device_proof(token: bytes | str, host_nonce: bytes, device_nonce: bytes) -> bytes:
    return hmac.new(parse_token(token), DEVICE_LABEL + host_nonce + device_nonce, hashlib.sha256).digest()


def _unauth(msg: str) -> ProtocolError:
    return ProtocolError(ErrorCode.UNAUTHENTICATED, msg)


def _expect(msg: Message, want: MsgType, who: str) -> Message:
    if msg.type == MsgType.ERROR and who == "device":
        raise ProtocolError(ErrorCode.parse(msg["code"]), f"device refused the handshake: {msg['message']}")
    if msg.type != want:
        raise _unauth(f"expected {want.name} during the handshake, got {msg.type.name}; "
                      "authenticate before sending anything else")
    return msg


class DeviceAuth:
    """Per-device authentication state, shared by all connections: the token, the single host
    session slot, and the host nonces already seen (replay protection)."""

    def __init__(self, token: bytes | str, device_name: str, *,
                 rng: Callable[[int], bytes] = secrets.token_bytes, remember: int = REMEMBERED_NONCES):
        self._token = parse_token(token)
        self.device_name = device_name
        self._rng = rng
        self._lock = threading.Lock()
        self._seen: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._remember = remember
        self._holder: DeviceHandshake | None = None

    @property
    def busy(self) -> bool:
        return self._holder is not None

    def handshake(self) -> "DeviceHandshake":
        """Start the handshake of a newly accepted connection."""
        return DeviceHandshake(self)

    def _note_nonce(self, nonce: bytes) -> bool:
        with self._lock:
            if nonce in self._seen:
                return False
            self._seen[nonce] = None
            while len(self._seen) > self._remember:
                self._seen.popitem(last=False)
            return True

    def _acquire(self, hs: "DeviceHandshake") -> bool:
        with self._lock:
            if self._holder is not None:
                return False
            self._holder = hs
            return True

    def _release(self, hs: "DeviceHandshake") -> None:
        with self._lock:
            if self._holder is hs:
                self._holder = None


class DeviceHandshake:
    """One connection's handshake, device side. Feed each received message to `handle()`, send
    what it returns; a ProtocolError means: send `error_reply(err)`, then close. Once
    `authenticated`, this object holds the device's single session slot until `close()`
    (also a context manager)."""

    def __init__(self, auth: DeviceAuth):
        self._auth = auth
        self.state = "await_request"
        self.host_name: str | None = None
        self._host_nonce = b""
        self._device_nonce = b""
        self._host_share = b""
        self._priv, self._device_share = _seal.new_share()
        self.keys: tuple[bytes, bytes] | None = None  # (host->device, device->host) once authenticated

    @property
    def authenticated(self) -> bool:
        return self.state == "done"

    def seal(self) -> "_seal.Seal":
        """The device's record layer: sends with the device->host key, opens with host->device."""
        return _seal.Seal(self.keys[1], self.keys[0])

    def handle(self, msg: Message) -> Message:
        if self.state == "await_request":
            return self.on_auth_request(msg)
        if self.state == "await_response":
            return self.on_auth_response(msg)
        raise ProtocolError(ErrorCode.UNEXPECTED, f"{msg.type.name} received in handshake state {self.state}")

    def _fail(self, err: ProtocolError) -> ProtocolError:
        self.state = "failed"
        return err

    def on_auth_request(self, msg: Message) -> Message:
        """AUTH_REQUEST -> AUTH_CHALLENGE."""
        if self.state != "await_request":
            raise self._fail(_unauth(f"AUTH_REQUEST in state {self.state}; open a new connection"))
        if msg.type != MsgType.AUTH_REQUEST:
            raise self._fail(_unauth(f"{msg.type.name} before authentication; send AUTH_REQUEST first"))
        if msg["protocol_version"] != PROTOCOL_VERSION:
            raise self._fail(ProtocolError(
                ErrorCode.BAD_VERSION,
                f"host speaks protocol version {msg['protocol_version']}, this device speaks {PROTOCOL_VERSION} "
                "(sealed sessions); upgrade the older side"))
        if "host_share" not in msg.meta:
            raise self._fail(_unauth(f"AUTH_REQUEST of protocol version {PROTOCOL_VERSION} without host_share; "
                                     "the host must send its X25519 share"))
        if self._auth.busy:
            raise self._fail(ProtocolError(ErrorCode.BUSY, "device already serves a host session; "
                                                           "stop the other host or wait for it to disconnect"))
        nonce = bytes.fromhex(msg["host_nonce"])
        if not self._auth._note_nonce(nonce):
            raise self._fail(_unauth("host nonce replayed; a host must use a fresh random nonce per connection"))
        self._host_nonce = nonce
        self._host_share = bytes.fromhex(msg["host_share"])
        self.host_name = msg["host_name"]
        self._device_nonce = self._auth._rng(NONCE_BYTES)
        if self._device_nonce == nonce:
            raise self._fail(_unauth("host nonce equals the device nonce; reflection refused"))
        self.state = "await_response"
        return Message(MsgType.AUTH_CHALLENGE, {"device_nonce": self._device_nonce.hex(),
                                                "device_name": self._auth.device_name,
                                                "device_share": self._device_share.hex()})

    def on_auth_response(self, msg: Message) -> Message:
        """AUTH_RESPONSE -> AUTH_OK (and the session slot is taken)."""
        if self.state != "await_response":
            raise self._fail(_unauth(f"AUTH_RESPONSE in state {self.state}; open a new connection"))
        if msg.type != MsgType.AUTH_RESPONSE:
            raise self._fail(_unauth(f"{msg.type.name} before authentication completed; send AUTH_RESPONSE"))
        want = host_proof(self._auth._token, self._host_nonce, self._device_nonce)
        if not hmac.compare_digest(want, bytes.fromhex(msg["host_proof"])):
            raise self._fail(_unauth("host proof does not match; the host holds a different pairing token "
                                     "(re-pair the device)"))
        dh = _seal.shared_secret(self._priv, self._host_share)
        if not self._auth._acquire(self):
            raise self._fail(ProtocolError(ErrorCode.BUSY, "device already serves a host session; "
                                                           "stop the other host or wait for it to disconnect"))
        self.keys = _seal.derive_keys(self._auth._token, self._host_nonce, self._device_nonce, dh,
                                      self._host_share, self._device_share)
        self._priv = None  # ephemeral: gone once the keys exist
        self.state = "done"
        proof = device_proof(self._auth._token, self._host_nonce, self._device_nonce)
        return Message(MsgType.AUTH_OK, {"device_proof": proof.hex()})

    def close(self) -> None:
        """Release the session slot (call when the connection closes or on SHUTDOWN)."""
        self._auth._release(self)
        if self.state != "done":
            self.state = "failed"
        else:
            self.state = "closed"

    def __enter__(self) -> "DeviceHandshake":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class HostHandshake:
    """One connection's handshake, host side: start() -> AUTH_REQUEST; on_challenge(msg) ->
    AUTH_RESPONSE; on_ok(msg) verifies the device's proof. Raises ProtocolError on failure
    (an ERROR from the device is raised with the device's code)."""

    def __init__(self, token: bytes | str, host_name: str = "zl-host", *,
                 rng: Callable[[int], bytes] = secrets.token_bytes):
        self._token = parse_token(token)
        self.host_name = host_name
        self._rng = rng
        self.state = "new"
        self.device_name: str | None = None
        self._host_nonce = b""
        self._device_nonce = b""
        self._priv, self._host_share = _seal.new_share()
        self._device_share = b""
        self.keys: tuple[bytes, bytes] | None = None  # (host->device, device->host) once authenticated

    @property
    def authenticated(self) -> bool:
        return self.state == "done"

    def seal(self) -> "_seal.Seal":
        """The host's record layer: sends with the host->device key, opens with device->host."""
        return _seal.Seal(self.keys[0], self.keys[1])

    def start(self) -> Message:
        if self.state != "new":
            raise ProtocolError(ErrorCode.UNEXPECTED, "HostHandshake.start() called twice; use a new object")
        self._host_nonce = self._rng(NONCE_BYTES)
        self.state = "await_challenge"
        return Message(MsgType.AUTH_REQUEST, {"protocol_version": PROTOCOL_VERSION,
                                              "host_nonce": self._host_nonce.hex(),
                                              "host_name": self.host_name,
                                              "host_share": self._host_share.hex()})

    def on_challenge(self, msg: Message) -> Message:
        if self.state != "await_challenge":
            raise ProtocolError(ErrorCode.UNEXPECTED, f"challenge received in state {self.state}")
        self.state = "failed"
        _expect(msg, MsgType.AUTH_CHALLENGE, "device")
        self._device_nonce = bytes.fromhex(msg["device_nonce"])
        if self._device_nonce == self._host_nonce:
            raise _unauth("device nonce equals the host nonce; reflection refused")
        if "device_share" not in msg.meta:
            raise ProtocolError(ErrorCode.BAD_VERSION,
                                f"device sent no device_share: it speaks protocol version 1 (unsealed), this host "
                                f"{PROTOCOL_VERSION} (sealed sessions); upgrade the device")
        self._device_share = bytes.fromhex(msg["device_share"])
        self.device_name = msg["device_name"]
        self.state = "await_ok"
        return Message(MsgType.AUTH_RESPONSE,
                       {"host_proof": host_proof(self._token, self._host_nonce, self._device_nonce).hex()})

    def on_ok(self, msg: Message) -> None:
        if self.state != "await_ok":
            raise ProtocolError(ErrorCode.UNEXPECTED, f"AUTH_OK received in state {self.state}")
        self.state = "failed"
        _expect(msg, MsgType.AUTH_OK, "device")
        want = device_proof(self._token, self._host_nonce, self._device_nonce)
        if not hmac.compare_digest(want, bytes.fromhex(msg["device_proof"])):
            raise _unauth("device proof does not match; this device holds a different pairing token "
                          "(or is an impostor): re-pair it")
        self.keys = _seal.derive_keys(self._token, self._host_nonce, self._device_nonce,
                                      _seal.shared_secret(self._priv, self._device_share),
                                      self._host_share, self._device_share)
        self._priv = None
        self.state = "done"


# ---- over a blocking socket ------------------------------------------------------------------

def host_handshake(sock: socket.socket, token: bytes | str, host_name: str = "zl-host") -> Message:
    """Authenticate to the device on `sock` (host side); returns the device's HELLO."""
    hs = HostHandshake(token, host_name)
    send_message(sock, hs.start())
    send_message(sock, hs.on_challenge(recv_message(sock, max_frame=PREAUTH_MAX_FRAME)))
    hs.on_ok(recv_message(sock, max_frame=PREAUTH_MAX_FRAME))
    # HELLO is the first sealed frame: opening it confirms both sides derived the same keys
    _seal.install(sock, None if _seal.sealing_disabled_for_benchmark() else hs.seal())
    hello = recv_message(sock, max_frame=PREAUTH_MAX_FRAME)
    if hello.type == MsgType.ERROR:
        raise ProtocolError(ErrorCode.parse(hello["code"]), f"device error after handshake: {hello['message']}")
    if hello.type != MsgType.HELLO:
        raise ProtocolError(ErrorCode.UNEXPECTED, f"expected HELLO after AUTH_OK, got {hello.type.name}")
    return hello


def device_handshake(sock: socket.socket, auth: DeviceAuth, hello: Message,
                     timeout: float | None = None) -> DeviceHandshake:
    """Authenticate the host on `sock` (device side) and send `hello`. Returns the handshake,
    which holds the session slot: close() it when the connection ends. On failure the ERROR is
    sent (best effort) and the ProtocolError re-raised; the caller closes the socket. With
    `timeout`, the whole handshake must be done in that many seconds (section 6: TIMEOUT), however
    slowly the peer trickles its bytes; the socket's timeout is left changed."""
    hs = auth.handshake()
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        try:
            for _ in range(2):
                send_message(sock, hs.handle(recv_message(sock, max_frame=PREAUTH_MAX_FRAME, deadline=deadline)))
            # AUTH_OK went out plain; everything after it is sealed (6.1)
            _seal.install(sock, None if _seal.sealing_disabled_for_benchmark() else hs.seal())
            if deadline is not None:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
            send_message(sock, hello)
        except socket.timeout:
            raise ProtocolError(ErrorCode.TIMEOUT, f"handshake not completed within {timeout:g} s; "
                                                   "a host authenticates right after it connects") from None
    except ProtocolError as e:
        hs.close()
        try:
            if deadline is not None:
                sock.settimeout(1.0)  # the error may go out after the deadline; a peer not reading gets nothing
            send_message(sock, error_reply(e))
        except OSError:
            pass
        raise
    except BaseException:
        hs.close()
        raise
    return hs
