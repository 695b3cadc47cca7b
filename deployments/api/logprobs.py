"""Logprobs at the ingress: the replica's wire items in the OpenAI chat and completions shapes.

The replica sends each token's logprob with its text (deployments/protocol/logprob_items.py;
`bytes` are the text's UTF-8, so a token that is part of a multi-byte character shows U+FFFD).
The ingress, which holds no tokenizer, turns them into the chat shape
(`choices[].logprobs.content[]`) or the completions shape (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`). A masked token's -inf is written as -9999.0, as vLLM does, since
JSON has no infinity.
"""

from __future__ import annotations

import math
from typing import Any

NEG_INF_LOGPROB = -9999.0


def finite(value: float) -> float:
    return value if math.isfinite(value) else NEG_INF_LOGPROB


def _entry(token: str, logprob: float | None) -> dict[str, Any]:
    value = NEG_INF_LOGPROB if logprob is None else finite(logprob)
    return {"token": token, "logprob": value, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(items: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI chat `logprobs`: `{"content": [{token, logprob, bytes, top_logprobs}]}`."""
    return {
        "content": [
            {
                **_entry(item["token"], item["logprob"]),
                "top_logprobs": [_entry(t["token"], t["logprob"]) for t in item["top"]],
            }
            for item in items
        ]
    }


def completion_logprobs(items: list[dict[str, Any]], text_offset: int = 0) -> dict[str, Any]:
    """OpenAI completions `logprobs`; an item with logprob None (the first echoed prompt
    token) has null entries; offsets count from `text_offset`."""
    offsets: list[int] = []
    pos = text_offset
    for item in items:
        offsets.append(pos)
        pos += len(item["token"])
    return {
        "tokens": [i["token"] for i in items],
        "token_logprobs": [None if i["logprob"] is None else finite(i["logprob"]) for i in items],
        "top_logprobs": [
            None if i["logprob"] is None else {t["token"]: finite(t["logprob"]) for t in i["top"]}
            for i in items
        ],
        "text_offset": offsets,
    }


def mean_logprob(items: list[dict[str, Any]]) -> float:
    """best_of's ranking score: the mean token logprob of a choice (-inf when empty)."""
    values = [i["logprob"] for i in items if i["logprob"] is not None]
    if not values:
        return -math.inf
    return sum(values) / len(values)
