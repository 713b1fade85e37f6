"""ZeroLock wire protocol v1 (ZLWP/1). The specification is docs/PROTOCOL.md.

Modules: errors (codes, ProtocolError), tensors (tensor records, dtypes, torch/bf16 helpers),
messages (MsgType, Message, schemas), frames (framing, encode/decode), transport (sockets,
RateLimiter), handshake (HMAC challenge-response).
"""
from .errors import ConnectionClosed, ErrorCode, ProtocolError
from .frames import (
    DEFAULT_MAX_FRAME,
    HEADER_SIZE,
    MAGIC,
    MAX_META_BYTES,
    PREAUTH_MAX_FRAME,
    PROTOCOL_VERSION,
    TRAILER_SIZE,
    FrameDecoder,
    FrameHeader,
    decode_frame,
    decode_message,
    encode_message,
    encode_parts,
    parse_header,
)
from .handshake import (
    DeviceAuth,
    DeviceHandshake,
    HostHandshake,
    device_handshake,
    device_proof,
    host_handshake,
    host_proof,
    new_token,
    parse_token,
)
from .messages import Message, MsgType, error_reply, validate
from .tensors import BFloat16Bits, DType, bf16_from_float32, bf16_to_float32, from_torch, to_float_values, to_torch
from .transport import RateLimiter, recv_message, send_message


def error_message(code: ErrorCode | str, message: str, request_id: int | None = None) -> Message:
    """An ERROR message."""
    return error_reply(ProtocolError(ErrorCode(code), message), request_id)


__all__ = [
    "ConnectionClosed", "ErrorCode", "ProtocolError", "DEFAULT_MAX_FRAME", "HEADER_SIZE", "MAGIC",
    "MAX_META_BYTES", "PREAUTH_MAX_FRAME", "PROTOCOL_VERSION", "TRAILER_SIZE", "FrameDecoder",
    "FrameHeader", "decode_frame", "decode_message", "encode_message", "encode_parts", "parse_header",
    "DeviceAuth", "DeviceHandshake", "HostHandshake", "device_handshake", "device_proof",
    "host_handshake", "host_proof", "new_token", "parse_token", "Message", "MsgType", "error_reply", "validate",
    "BFloat16Bits", "DType", "bf16_from_float32", "bf16_to_float32", "from_torch", "to_float_values",
    "to_torch", "RateLimiter", "recv_message", "send_message", "error_message",
]
