"""Frames on the wire: msgpack maps whose numpy arrays are tagged maps.

The format of openpi_client/msgpack_numpy.py (openpi-client 0.1.x), written here:

    array   {b"__ndarray__": True, b"data": raw bytes, b"dtype": dtype.str, b"shape": [..]}
    scalar  {b"__npgeneric__": True, b"data": value, b"dtype": dtype.str}

An error is a text frame: openpi's client raises RuntimeError with its text. Arrays of
object, void or complex dtype are refused both ways (openpi refuses them too: object
arrays would need pickle).
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

REFUSED_KINDS = ("V", "O", "c")  # void, object, complex: as openpi_client.pack_array


def _pack_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray | np.generic) and obj.dtype.kind in REFUSED_KINDS:
        raise ValueError(f"cannot send an array of dtype {obj.dtype}")
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str,
                b"shape": obj.shape}  # fmt: skip
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot send {type(obj).__name__}")


def _unpack_hook(obj: dict) -> Any:
    if b"__ndarray__" in obj:
        return _array(obj)
    if b"__npgeneric__" in obj:
        dtype = _dtype(obj.get(b"dtype"))
        try:
            return dtype.type(obj[b"data"])
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise ValueError(f"numpy scalar of dtype {dtype}: {e}") from None
    return obj


def _dtype(text: Any) -> np.dtype:
    try:
        dtype = np.dtype(text)
    except TypeError:
        raise ValueError(f"array dtype {text!r} is not a numpy dtype") from None
    if dtype.kind in REFUSED_KINDS:
        raise ValueError(f"array dtype {dtype} is refused (object, void and complex)")
    return dtype


def _array(obj: dict) -> np.ndarray:
    dtype = _dtype(obj.get(b"dtype"))
    data, shape = obj.get(b"data"), obj.get(b"shape")
    if not isinstance(data, bytes) or not isinstance(shape, list | tuple):
        raise ValueError("array without its bytes or its shape")
    if not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ValueError(f"array shape {shape!r} is not a list of sizes")
    need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if need != len(data):
        raise ValueError(f"array {tuple(shape)} of {dtype} needs {need} bytes, got {len(data)}")
    return np.ndarray(buffer=data, dtype=dtype, shape=tuple(shape))  # read-only view


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_pack_default)


def unpack(frame: bytes | str) -> dict:
    """A request frame -> its map; ValueError saying why it is not one."""
    if isinstance(frame, str):
        raise ValueError("expected a binary msgpack frame, got a text frame")
    try:
        obj = msgpack.unpackb(frame, object_hook=_unpack_hook)
    except Exception as e:  # our hook's ValueError; msgpack's ExtraData, FormatError, ...
        raise ValueError(f"not a request frame ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a msgpack map, got {type(obj).__name__}")
    return obj
