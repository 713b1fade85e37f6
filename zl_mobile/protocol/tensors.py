"""Tensor records (docs/PROTOCOL.md section 4): dtype + shape + raw little-endian bytes + CRC32.

Decoded tensors are numpy arrays that view the received buffer (no copy). bfloat16 has no numpy
dtype: it travels as raw uint16 bit patterns in a `BFloat16Bits` array (an ndarray subclass), so
re-encoding keeps the dtype; `to_torch` / `from_torch` convert to and from torch.bfloat16.
"""
from __future__ import annotations

import enum
import struct
import zlib

import numpy as np

from .errors import ErrorCode, ProtocolError
from .quoting import quote_any

MAX_NAME_BYTES = 1024
MAX_NDIM = 8
ALIGN = 8


class DType(enum.IntEnum):
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    INT64 = 4
    INT32 = 5
    UINT8 = 6
    BOOL = 7

    @property
    def wire_name(self) -> str:
        return self.name.lower()

    @property
    def itemsize(self) -> int:
        return _NUMPY[self].itemsize


class BFloat16Bits(np.ndarray):
    """uint16 array whose elements are bfloat16 bit patterns. Make one with
    `bits.view(BFloat16Bits)`, `bf16_from_float32(x)` or `from_torch(t_bf16)`."""


_NUMPY = {
    DType.FLOAT32: np.dtype("<f4"),
    DType.FLOAT16: np.dtype("<f2"),
    DType.BFLOAT16: np.dtype("<u2"),
    DType.INT64: np.dtype("<i8"),
    DType.INT32: np.dtype("<i4"),
    DType.UINT8: np.dtype("u1"),
    DType.BOOL: np.dtype("?"),
}
_BY_KIND = {(d.kind, d.itemsize): code for code, d in _NUMPY.items() if code != DType.BFLOAT16}


def dtype_of(arr: np.ndarray) -> DType:
    """The wire dtype of a numpy array; raises MALFORMED for dtypes the protocol does not carry."""
    if isinstance(arr, BFloat16Bits):
        if arr.dtype.kind != "u" or arr.dtype.itemsize != 2:
            raise ProtocolError(ErrorCode.MALFORMED,
                                f"BFloat16Bits array has dtype {arr.dtype}; it must hold uint16 bit patterns")
        return DType.BFLOAT16
    if arr.dtype.name == "bfloat16":  # ml_dtypes, if someone uses it
        return DType.BFLOAT16
    code = _BY_KIND.get((arr.dtype.kind, arr.dtype.itemsize))
    if code is None:
        raise ProtocolError(ErrorCode.MALFORMED,
                            f"dtype {arr.dtype} is not carried by the protocol; cast to one of "
                            f"{', '.join(d.wire_name for d in DType)}")
    return code


def as_wire_array(value) -> tuple[DType, np.ndarray]:
    """Normalise a numpy array / torch tensor / BFloat16Bits to (dtype, C-contiguous LE array)."""
    if not isinstance(value, np.ndarray):
        if type(value).__module__.startswith("torch"):
            value = from_torch(value)
        else:
            raise ProtocolError(ErrorCode.MALFORMED,
                                f"tensor value of type {type(value).__name__} is not a numpy array or torch tensor")
    code = dtype_of(value)
    arr = np.asarray(value).view(np.ndarray) if code == DType.BFLOAT16 else np.asarray(value)
    want = _NUMPY[code]
    if arr.dtype != want:
        arr = arr.astype(want) if arr.dtype.name != "bfloat16" else arr.view("<u2")
    return code, np.ascontiguousarray(arr)


def _pad(offset: int) -> int:
    return (-offset) % ALIGN


def encode_record(name: str, value, offset: int) -> tuple[bytes, memoryview, int]:
    """Encode one tensor record that starts at body offset `offset`.
    Returns (record header incl. padding, data bytes view, offset after the record)."""
    if not isinstance(name, str):
        raise ProtocolError(ErrorCode.MALFORMED, f"tensor name {quote_any(name)} is not a string")
    try:
        name_b = name.encode("utf-8")
    except UnicodeEncodeError:
        raise ProtocolError(ErrorCode.MALFORMED, f"tensor name {quote_any(name)} is not valid Unicode") from None
    if not 1 <= len(name_b) <= MAX_NAME_BYTES:
        raise ProtocolError(ErrorCode.MALFORMED,
                            f"tensor name of {len(name_b)} bytes; names must be 1..{MAX_NAME_BYTES} UTF-8 bytes")
    code, arr = as_wire_array(value)
    if arr.ndim > MAX_NDIM:
        raise ProtocolError(ErrorCode.MALFORMED, f"tensor {quote_any(name)} has {arr.ndim} dims; at most {MAX_NDIM}")
    prod = 1
    for d in arr.shape:
        prod *= max(d, 1)
    if prod >= 1 << 32:
        raise ProtocolError(ErrorCode.MALFORMED, f"tensor {quote_any(name)} shape {arr.shape}: product of non-zero dims >= 2**32")
    data = memoryview(arr.reshape(-1).view(np.uint8))
    nbytes = data.nbytes
    if nbytes > 0xFFFFFFFF:
        raise ProtocolError(ErrorCode.OVERSIZED, f"tensor {quote_any(name)} has {nbytes} bytes; split it below 4 GiB")
    head = (struct.pack("<H", len(name_b)) + name_b + struct.pack("<BB", code, arr.ndim)
            + struct.pack(f"<{arr.ndim}I", *arr.shape) + struct.pack("<II", nbytes, zlib.crc32(data)))
    pad = _pad(offset + len(head))
    head += b"\0" * pad
    return head, data, offset + len(head) + nbytes


def _malformed(msg: str) -> ProtocolError:
    return ProtocolError(ErrorCode.MALFORMED, msg)


def decode_record(body: memoryview, pos: int) -> tuple[str, np.ndarray, int]:
    """Decode the tensor record at `pos` of `body`. Returns (name, array viewing body, next pos).
    Checks sizes against the body before touching any data; never allocates more than a name."""
    end = len(body)

    def take(n: int, what: str) -> int:
        nonlocal pos
        if n > end - pos:
            raise _malformed(f"tensor record runs past the end of the body while reading {what}; "
                             "the sender wrote an inconsistent record")
        start = pos
        pos += n
        return start

    s = take(2, "name_len")
    (name_len,) = struct.unpack_from("<H", body, s)
    if not 1 <= name_len <= MAX_NAME_BYTES:
        raise _malformed(f"tensor name_len {name_len}; names must be 1..{MAX_NAME_BYTES} bytes")
    s = take(name_len, "name")
    try:
        name = bytes(body[s:s + name_len]).decode("utf-8")
    except UnicodeDecodeError:
        raise _malformed("tensor name is not valid UTF-8") from None
    s = take(2, "dtype/ndim")
    code, ndim = body[s], body[s + 1]
    try:
        dtype = DType(code)
    except ValueError:
        raise _malformed(f"tensor {quote_any(name)} has unknown dtype code {code}; "
                         f"known codes are 1..{len(DType)}") from None
    if ndim > MAX_NDIM:
        raise _malformed(f"tensor {quote_any(name)} has ndim {ndim}; at most {MAX_NDIM}")
    s = take(4 * ndim, "dims")
    shape = struct.unpack_from(f"<{ndim}I", body, s)
    s = take(8, "nbytes/crc")
    nbytes, crc = struct.unpack_from("<II", body, s)
    prod = 1
    for d in shape:
        if d:
            prod *= d
            if prod >= 1 << 32:
                raise _malformed(f"tensor {quote_any(name)} shape {list(shape)}: product of non-zero dims >= 2**32")
    count = 0 if 0 in shape else prod
    if count * dtype.itemsize != nbytes:
        raise _malformed(f"tensor {quote_any(name)}: nbytes {nbytes} != {count} elements x {dtype.itemsize} bytes "
                         f"for shape {list(shape)} {dtype.wire_name}")
    pad = _pad(pos)
    s = take(pad, "padding")
    if any(body[s:s + pad]):
        raise _malformed(f"tensor {quote_any(name)} has non-zero padding bytes")
    s = take(nbytes, "data")
    data = body[s:s + nbytes]
    if zlib.crc32(data) != crc:
        raise ProtocolError(ErrorCode.BAD_CHECKSUM,
                            f"tensor {quote_any(name)} data CRC32 mismatch; the sender computed it over other bytes")
    arr = np.frombuffer(body, dtype=_NUMPY[dtype] if dtype != DType.BOOL else np.uint8,
                        count=count, offset=s)
    if dtype == DType.BOOL:
        if count and int(arr.max()) > 1:
            raise _malformed(f"bool tensor {quote_any(name)} holds a byte other than 0 or 1")
        arr = arr.view(np.bool_)
    arr = arr.reshape(shape)
    if dtype == DType.BFLOAT16:
        arr = arr.view(BFloat16Bits)
    return name, arr, pos


# ---- conversions ---------------------------------------------------------------------------

def bf16_from_float32(x) -> BFloat16Bits:
    """Round float32 values to bfloat16 (nearest even; NaN stays NaN)."""
    f = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    u = f.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded.view(BFloat16Bits)


def bf16_to_float32(bits) -> np.ndarray:
    u = np.asarray(bits).view(np.ndarray).astype(np.uint32) << 16
    return u.view(np.float32)


def to_float_values(arr: np.ndarray) -> np.ndarray:
    """Plain numpy view of a decoded tensor's values (bfloat16 widened to float32)."""
    if isinstance(arr, BFloat16Bits):
        return bf16_to_float32(arr)
    return np.asarray(arr)


def from_torch(t) -> np.ndarray:
    """torch.Tensor -> numpy array for the wire (bfloat16 -> BFloat16Bits). Shares memory when
    the tensor is on CPU and contiguous."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16).view(BFloat16Bits)
    return t.numpy()


def to_torch(arr: np.ndarray):
    """Decoded tensor -> torch.Tensor (BFloat16Bits -> torch.bfloat16). Copies when the array is
    read-only or unaligned (torch needs writable, aligned storage)."""
    import torch

    a = np.asarray(arr)
    a = np.require(a, requirements=["C", "A", "W"])
    if isinstance(arr, BFloat16Bits):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
