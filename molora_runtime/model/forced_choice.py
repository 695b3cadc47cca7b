"""An operator's forced choice among measured CPU kinds, read from one environment variable.

The CPU GEMM and the CPU decode attention each pick a kind by timing on this machine; a variable
(`auto` by default) forces one for side-by-side runs, and a misspelled value is refused rather
than silently measured.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


def forced_choice(env: str, kinds: Sequence[str]) -> str | None:
    """The kind `env` forces, or None for `auto`; any value outside `kinds` is refused."""
    value = os.environ.get(env, "auto").strip().lower()
    if value == "auto":
        return None
    if value not in kinds:
        raise ValueError(f"{env}={value!r}: expected auto or one of {', '.join(kinds)}")
    return value
