"""Logprobs as the replica sends them: the engine's floats with each token's text, as wire items.

The engine reports (token id, logprob, top alternatives) as floats; the replica, which holds the
tokenizer, adds each token's text (the token decoded alone: OpenAI's `token`). The result is the
wire's `LogprobItem` shape (deployments/protocol/wire.py), which the ingress turns into the
OpenAI shapes (deployments/api/logprobs.py) without a tokenizer. It lives on the protocol floor,
beside the wire items it fills, because the replica produces it and the ingress reads it.
"""

from __future__ import annotations

from typing import Any

from molora_runtime.engine.types import TokenLogprob


def _text(tokenizer: Any, token_id: int) -> str:
    if tokenizer is None:
        return f"<{token_id}>"
    return str(tokenizer.decode([token_id], skip_special_tokens=False))


def _top(tokenizer: Any, top: list[tuple[int, float]]) -> list[dict[str, Any]]:
    return [{"token_id": t, "token": _text(tokenizer, t), "logprob": v} for t, v in top]


def logprob_items(lps: list[TokenLogprob], tokenizer: Any) -> list[dict[str, Any]]:
    """The engine's logprobs with token texts (replica side), as wire `LogprobItem` dicts."""
    return [
        {
            "token_id": lp.token_id,
            "token": _text(tokenizer, lp.token_id),
            "logprob": lp.logprob,
            "top": _top(tokenizer, lp.top),
        }
        for lp in lps
    ]


def prompt_items(
    ids: list[int], lps: list[TokenLogprob | None], tokenizer: Any
) -> list[dict[str, Any]]:
    """Every prompt token with its text; the first (and any without logits) has logprob None."""
    out = []
    for i, token_id in enumerate(ids):
        lp = lps[i] if i < len(lps) else None
        out.append(
            {
                "token_id": token_id,
                "token": _text(tokenizer, token_id),
                "logprob": None if lp is None else lp.logprob,
                "top": [] if lp is None else _top(tokenizer, lp.top),
            }
        )
    return out
