"""Publisher-chosen regular expressions, run only with a linear-time engine (RE2).

PEFT configs carry regexes (`target_modules` as a string, `rank_pattern` and `alpha_pattern`
keys). Python's backtracking `re` can take exponential time on a 30-character pattern while
holding the GIL, so these are compiled with RE2 (no backtracking, bounded memory), capped in
length, and only ever matched against canonical module paths the server builds itself.
"""

from __future__ import annotations

import functools
from typing import Any

import re2

MAX_PATTERN_CHARS = 256
MAX_PATTERNS = 64
# RE2 program memory per pattern: plenty for a module-path regex, far below a DFA blow-up.
MAX_PATTERN_MEM = 1 << 20


class PatternError(ValueError):
    """A publisher's regex is too long or not in the RE2 syntax (no backreferences, no lookaround)."""


def _options() -> Any:
    opts = re2.Options()
    opts.max_mem = MAX_PATTERN_MEM
    opts.log_errors = False
    return opts


@functools.lru_cache(maxsize=512)
def _compiled(pattern: str, wrap: bool) -> Any:
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PatternError(f"regex of {len(pattern)} characters, over {MAX_PATTERN_CHARS}")
    try:
        re2.compile(pattern, _options())  # the pattern alone must be a whole regex
        text = rf"(?:.*\.)?(?:{pattern})$" if wrap else pattern
        return re2.compile(text, _options())
    except re2.error as exc:
        raise PatternError(
            f"regex {pattern[:64]!r} is not valid RE2 syntax (no backreferences or lookaround): "
            f"{exc}"
        ) from None


def check_pattern(pattern: str) -> None:
    """Raise PatternError unless `pattern` is short and compiles with RE2."""
    _compiled(pattern, True)


def fullmatch(pattern: str, path: str) -> bool:
    """`re.fullmatch(pattern, path)` in linear time (PEFT's string `target_modules`)."""
    return _compiled(pattern, False).fullmatch(path) is not None


def suffix_match(pattern: str, path: str) -> bool:
    """PEFT's rank/alpha pattern rule `re.match(rf"(.*\\.)?({pattern})$", path)`, in linear time."""
    return _compiled(pattern, True).match(path) is not None
