"""A replica's `/tokenize` and `/detokenize` work: the engine's own tokenizer and chat template,
so the ids are exactly the ones a generation request with the same input would be given.

Input errors come back as `{"error": message}` (the router answers 400); the router has
already validated the payload's shape and sizes.
"""

from __future__ import annotations

from typing import Any

from molora_runtime.engine.request_check import RequestChecker
from molora_runtime.errors import InvalidRequestError


def tokenize(checker: RequestChecker, payload: dict[str, Any]) -> dict[str, Any]:
    """Ids of `payload["prompt"]` or of `payload["messages"]` through the chat template."""
    try:
        if payload.get("messages") is not None:
            text = checker.render_chat(
                payload["messages"],
                bool(payload.get("add_generation_prompt", True)),
                payload.get("chat_template_kwargs"),
            )
        else:
            text = str(payload["prompt"])
        ids = checker.encode_text(text, bool(payload.get("add_special_tokens", True)))
    except InvalidRequestError as exc:
        return {"error": str(exc)}
    out: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": checker.max_model_len,
        "tokens": ids,
        "token_strs": None,
    }
    if payload.get("return_token_strs"):
        out["token_strs"] = checker.tokenizer.convert_ids_to_tokens(ids)
    return out


def detokenize(checker: RequestChecker, tokens: list[int]) -> dict[str, Any]:
    try:
        return {"prompt": checker.decode_ids(list(tokens))}
    except InvalidRequestError as exc:
        return {"error": str(exc)}
