"""Read a safetensors header without torch: enough to check shapes, dtypes and file integrity.

Parsing the 8-byte length + JSON header ourselves keeps the store free of torch and lets us
refuse truncated files and pickles disguised as `.safetensors` before anything is uploaded.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from adapter_store.errors import InvalidInputError

MAX_HEADER_BYTES = 100 * 1024 * 1024
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


class TensorInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    dtype: str
    shape: tuple[int, ...]
    data_offsets: tuple[int, int] = Field(description="[begin, end) within the data section")


def _looks_pickled(head: bytes) -> bool:
    # torch.save writes a zip ("PK"); raw pickles start with the PROTO opcode 0x80. A
    # safetensors header length can start with the same bytes, but its JSON then opens at byte 8.
    if head[8:9] == b"{":
        return False
    return head[:2] == b"PK" or head[:1] == b"\x80"


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor name → info; raises InvalidInputError naming the file and the defect."""
    with path.open("rb") as fh:
        return read_header_from(fh, path.name, path.stat().st_size)


def read_header_from(fh: BinaryIO, name: str, size: int) -> dict[str, TensorInfo]:
    """`read_header` over an open file (or bytes in memory) of `size` bytes called `name`."""
    fh.seek(0)
    head = fh.read(9)
    fh.seek(8)
    if _looks_pickled(head):
        raise InvalidInputError(
            f"{name} is a pickle/torch.save file, not safetensors: pickles are refused"
        )
    if len(head) < 8:
        raise InvalidInputError(f"{name} is not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise InvalidInputError(f"{name} is not a valid safetensors file (bad header size)")
    try:
        raw = json.loads(fh.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidInputError(f"{name}: safetensors header is not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise InvalidInputError(f"{name}: safetensors header is not an object")
    raw.pop("__metadata__", None)
    tensors: dict[str, TensorInfo] = {}
    data_len = size - 8 - n
    for key, info in raw.items():
        try:
            t = TensorInfo.model_validate(info)
        except ValueError as exc:
            raise InvalidInputError(f"{name}: bad header entry for {key!r}: {exc}") from exc
        begin, end = t.data_offsets
        if t.dtype not in DTYPE_BYTES:
            raise InvalidInputError(f"{name}: tensor {key!r} has unknown dtype {t.dtype}")
        nbytes = math.prod(t.shape) * DTYPE_BYTES[t.dtype]
        if not 0 <= begin <= end <= data_len or end - begin != nbytes:
            raise InvalidInputError(
                f"{name}: tensor {key!r} lies outside the file or has the wrong byte size "
                "(truncated or corrupted file?)"
            )
        tensors[key] = t
    _check_disjoint(name, tensors)
    return tensors


def _check_disjoint(name: str, tensors: dict[str, TensorInfo]) -> None:
    """No two tensors may share bytes: one write would change the other."""
    spans = sorted((t.data_offsets, key) for key, t in tensors.items())
    reach, holder = 0, ""
    for (begin, end), key in spans:
        if begin == end:
            continue
        if begin < reach:
            raise InvalidInputError(
                f"{name}: tensors {holder!r} and {key!r} overlap in the file (byte "
                "ranges must be disjoint)"
            )
        reach, holder = end, key


def max_abs_values_from(
    fh: BinaryIO, name: str, size: int, header: dict[str, TensorInfo] | None = None
) -> dict[str, float]:
    """Largest |value| of each float tensor (NaN or Inf give a non-finite entry) of an open file
    (or bytes in memory) of `size` bytes called `name`, whose header the caller may have read
    already; each tensor is read at its offset."""
    if header is None:
        header = read_header_from(fh, name, size)
    fh.seek(0)
    (n,) = struct.unpack("<Q", fh.read(8))
    out: dict[str, float] = {}
    for key, info in header.items():
        if info.dtype not in FLOAT_DTYPES:
            continue
        arr = _float_view(fh, 8 + n, info)
        if arr.size == 0:
            out[key] = 0.0
        elif not np.isfinite(arr).all():
            out[key] = float("inf")
        else:
            out[key] = float(np.abs(arr).max())
    return out


def nonfinite_tensors(path: Path) -> list[str]:
    """Names of the float tensors of `path` holding NaN or Inf (one header read, one pass)."""
    header = read_header(path)
    return [
        name
        for name, info in header.items()
        if info.dtype in FLOAT_DTYPES and not np.isfinite(_read_float(path, name, info)).all()
    ]


def _read_float(path: Path, name: str, info: TensorInfo) -> np.ndarray:
    if info.dtype not in FLOAT_DTYPES:
        raise InvalidInputError(f"{path.name}: tensor {name!r} must be float, got {info.dtype}")
    with path.open("rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return _float_view(fh, 8 + n, info).reshape(info.shape)


def _float_view(fh: BinaryIO, data_start: int, info: TensorInfo) -> np.ndarray:
    """One float tensor's values as a flat float32 array, read at its offset."""
    fh.seek(data_start + info.data_offsets[0])
    buf = fh.read(info.data_offsets[1] - info.data_offsets[0])
    if info.dtype == "BF16":
        return (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    arr = np.frombuffer(buf, dtype={"F64": "<f8", "F32": "<f4", "F16": "<f2"}[info.dtype])
    return arr.astype(np.float32, copy=False)
