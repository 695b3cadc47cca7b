"""Byte sizes in configs: an integer, or a number with a unit ("512MiB", "2 GB").

Every tier (host memory, disk cache) is sized in bytes, and a YAML author should be able to
write the unit instead of counting zeros; a typo must fail with the accepted forms named.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BeforeValidator

UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: object) -> int:
    """`value` as a whole number of bytes; ValueError naming the accepted forms otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative (got {value})")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match and match.group(2).lower() in UNITS:
            return int(float(match.group(1)) * UNITS[match.group(2).lower()])
    raise ValueError(
        f"{value!r} is not a size: use a byte count (an integer) or a number with one of "
        "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. '512MiB')"
    )


# A config field in bytes that also accepts a unit ("512MiB"); Field constraints still apply.
ByteSize = Annotated[int, BeforeValidator(parse_bytes)]
