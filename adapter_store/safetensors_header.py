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
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(9)
        fh.seek(8)
        if _looks_pickled(head):
            raise InvalidInputError(
                f"{path.name} is a pickle/torch.save file, not safetensors: pickles are refused"
            )
        if len(head) < 8:
            raise InvalidInputError(f"{path.name} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head[:8])
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise InvalidInputError(
                f"{path.name} is not a valid safetensors file (bad header size)"
            )
        try:
            raw = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidInputError(f"{path.name}: safetensors header is not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise InvalidInputError(f"{path.name}: safetensors header is not an object")
    raw.pop("__metadata__", None)
    tensors: dict[str, TensorInfo] = {}
    data_len = size - 8 - n
    for name, info in raw.items():
        try:
            t = TensorInfo.model_validate(info)
        except ValueError as exc:
            raise InvalidInputError(f"{path.name}: bad header entry for {name!r}: {exc}") from exc
        begin, end = t.data_offsets
        if t.dtype not in DTYPE_BYTES:
            raise InvalidInputError(f"{path.name}: tensor {name!r} has unknown dtype {t.dtype}")
        nbytes = math.prod(t.shape) * DTYPE_BYTES[t.dtype]
        if not 0 <= begin <= end <= data_len or end - begin != nbytes:
            raise InvalidInputError(
                f"{path.name}: tensor {name!r} lies outside the file or has the wrong byte size "
                "(truncated or corrupted file?)"
            )
        tensors[name] = t
    _check_disjoint(path, tensors)
    return tensors


def _check_disjoint(path: Path, tensors: dict[str, TensorInfo]) -> None:
    """No two tensors may share bytes: one write would change the other."""
    spans = sorted((t.data_offsets, name) for name, t in tensors.items())
    reach, holder = 0, ""
    for (begin, end), name in spans:
        if begin == end:
            continue
        if begin < reach:
            raise InvalidInputError(
                f"{path.name}: tensors {holder!r} and {name!r} overlap in the file (byte "
                "ranges must be disjoint)"
            )
        reach, holder = end, name


def max_abs_values(path: Path) -> dict[str, float]:
    """Largest |value| of each float tensor of `path` (NaN or Inf give a non-finite entry); the
    file is opened once, each tensor read at its offset."""
    header = read_header(path)
    out: dict[str, float] = {}
    with path.open("rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        for name, info in header.items():
            if info.dtype not in FLOAT_DTYPES:
                continue
            arr = _float_view(fh, 8 + n, info)
            if arr.size == 0:
                out[name] = 0.0
            elif not np.isfinite(arr).all():
                out[name] = float("inf")
            else:
                out[name] = float(np.abs(arr).max())
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
