"""The rulebook's bounds on publisher input, and the linear-time checks that enforce them.

`adapter_store.rules` applies these; they live apart so the numbers are in one short place.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from adapter_store.patterns import MAX_PATTERN_CHARS, MAX_PATTERNS, PatternError, check_pattern

MAX_RANK = 1024
MAX_ABS_ALPHA = 4096.0
# Slot contents (A and scale * B): far inside float16's 65504, so scale and cast stay finite.
MAX_ABS_WEIGHT = 1.0e4
MAX_CONFIG_BYTES = 64 * 1024
MAX_CONFIG_DEPTH = 8
MAX_KEY_CHARS = 512


def check_patterns(
    target_modules: list[str] | str,
    rank_pattern: Mapping[str, int],
    alpha_pattern: Mapping[str, float],
) -> None:
    """Counts, lengths, values and RE2 syntax of a PEFT config's names and regexes (ValueError)."""
    targets = target_modules
    if isinstance(targets, list) and (
        len(targets) > MAX_PATTERNS or any(len(t) > MAX_PATTERN_CHARS for t in targets)
    ):
        raise ValueError(
            f"target_modules: at most {MAX_PATTERNS} names of {MAX_PATTERN_CHARS} characters"
        )
    for what, patterns in (
        ("rank_pattern", rank_pattern),
        ("alpha_pattern", alpha_pattern),
    ):
        if len(patterns) > MAX_PATTERNS:
            raise ValueError(f"{what}: more than {MAX_PATTERNS} patterns")
    for value in rank_pattern.values():
        if not 1 <= value <= MAX_RANK:
            raise ValueError(f"rank_pattern: rank {value} outside [1, {MAX_RANK}]")
    for value in alpha_pattern.values():
        if not math.isfinite(value) or abs(value) > MAX_ABS_ALPHA:
            raise ValueError(f"alpha_pattern: alpha {value} outside ±{MAX_ABS_ALPHA:g}")
    try:
        if isinstance(targets, str):
            check_pattern(targets)
        for pattern in [*rank_pattern, *alpha_pattern]:
            check_pattern(pattern)
    except PatternError as exc:
        raise ValueError(str(exc)) from None


def json_depth(text: str) -> int:
    """Deepest bracket nesting of a JSON text, in one linear scan (no recursion)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest
