"""The chaos benchmark's streams: greedy completions that record every token they got and the
exact versions they report, how each one ended, and the check of each against a solo reference.

A stream's end is one of:
- `refused`: a status other than 200 (an answer: 404 for a yanked name, 429, 503 + Retry-After);
- `complete`: `finish_reason`, then `[DONE]`, with exactly `max_tokens` tokens (ignore_eos);
- `error_event`: an SSE event with `error` (the server said the stream failed);
- `transport_error`: the connection broke and the client raised (what an SDK raises);
- `truncated_success`: `[DONE]` without an error but short of `max_tokens` or without a finish;
- `silent_eof`: the body ended with neither `[DONE]` nor an error;
- `hung`: no byte for `read_timeout_s` (the client gave up; counted with the silent losses).
The last three are "lost without status" (goal 0).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

# Shared long prefix (prefix cache on): every prompt starts with it, then differs.
PREFIX = (
    "The archive of the northern observatory holds records of every clear night since the "
    "founding of the station, written by keepers who measured the positions of wandering "
    "stars, the brightness of comets, and the slow drift of the pole. "
) * 3
SUFFIXES = [
    "Summarize the keeper's last entry:",
    "List three instruments the keepers used:",
    "Describe the winter of the great comet:",
    "Write the first line of a new entry:",
]
PROMPTS = [PREFIX + s for s in SUFFIXES]
LOST = ("truncated_success", "silent_eof", "hung")
# A token is wrong when its text differs from the reference's, or its logprob differs by more
# than this (a wrong adapter moves logprobs by far more; the same weights agree to ~1e-5 here).
LOGPROB_TOL = 1e-3


@dataclass
class StreamResult:
    holder: str
    model: str  # as asked (a name, a mix, a composition)
    prompt: int
    max_tokens: int
    t_start: float
    t_end: float = 0.0
    status: int | None = None
    versions: list[str] | None = None
    tokens: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    done: bool = False
    error: str | None = None
    end: str = "silent_eof"
    ttft: float | None = None
    retry_after: str | None = None
    request_id: str | None = None  # the server's x-request-id, to find it in the logs

    def pinned(self) -> str | None:
        """The model string that names exactly the versions this stream reported."""
        return pinned_model(self.model, self.versions)


def pinned_model(model: str, versions: list[str] | None) -> str | None:
    if not versions:
        return None
    if versions[0].startswith("composition:"):
        return versions[0].removeprefix("composition:")
    if ":" not in model:  # a single adapter
        return versions[0]
    by_name = {v.partition("@")[0]: v for v in versions}
    parts = []
    for term in model.split("+"):
        name, _, weight = term.rpartition(":")
        parts.append(f"{by_name.get(name.partition('@')[0], name)}:{weight}")
    return "+".join(parts)


def completion_body(model: str, prompt: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": PROMPTS[prompt],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "logprobs": 0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


async def run_stream(
    http: httpx.AsyncClient,
    holder: str,
    key: str,
    model: str,
    prompt: int,
    max_tokens: int,
    read_timeout_s: float = 90.0,
    **extra: Any,
) -> StreamResult:
    res = StreamResult(holder, model, prompt, max_tokens, time.monotonic())
    body = completion_body(model, prompt, max_tokens, **extra)
    headers = {"Authorization": f"Bearer {key}"}
    timeout = httpx.Timeout(read_timeout_s, connect=30)
    usage = None
    try:
        async with http.stream(
            "POST", "/v1/completions", json=body, headers=headers, timeout=timeout
        ) as resp:
            res.status = resp.status_code
            res.request_id = resp.headers.get("x-request-id")
            if resp.status_code != 200:
                res.retry_after = resp.headers.get("retry-after")
                res.error = (await resp.aread()).decode(errors="replace")[:300]
                res.end = "refused"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    res.done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    res.error = json.dumps(event["error"])[:300]
                    res.end = "error_event"
                    continue
                if res.versions is None and "molora" in event:
                    res.versions = event["molora"].get("versions")
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices") or []:
                    lp = choice.get("logprobs") or {}
                    if lp.get("tokens"):
                        if res.ttft is None:
                            res.ttft = time.monotonic() - res.t_start
                        res.tokens += lp["tokens"]
                        res.logprobs += lp["token_logprobs"]
                    if choice.get("finish_reason"):
                        res.finish = choice["finish_reason"]
        if res.end != "error_event":
            whole = res.finish is not None and len(res.tokens) == max_tokens
            whole = whole and (usage is None or usage.get("completion_tokens") == max_tokens)
            if res.done:
                res.end = "complete" if whole else "truncated_success"
            else:
                res.end = "silent_eof"
    except httpx.ReadTimeout as exc:
        res.end, res.error = "hung", repr(exc)
    except httpx.HTTPError as exc:
        if res.end != "error_event":
            res.end, res.error = "transport_error", repr(exc)
    finally:
        res.t_end = time.monotonic()
    return res


@dataclass
class Reference:
    tokens: list[str]
    logprobs: list[float]


async def references(
    url: str, key: str, wanted: dict[tuple[str, int], int], concurrency: int
) -> tuple[dict[tuple[str, int], Reference], list[str]]:
    """A run of each (pinned model, prompt) alone on the server: greedy, `max_tokens` the longest
    any stream asked, a fresh `cache_salt` so no block cached during the chaos is read. Returns
    the references and the keys that could not be run (with why)."""
    out: dict[tuple[str, int], Reference] = {}
    failed: list[str] = []
    todo = list(wanted.items())
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:

        async def worker() -> None:
            while todo:
                (model, prompt), n = todo.pop()
                salt = secrets.token_hex(8)
                r = await run_stream(http, "reference", key, model, prompt, n, cache_salt=salt)
                if r.end == "complete":
                    out[(model, prompt)] = Reference(r.tokens, r.logprobs)
                else:
                    failed.append(f"{model} p{prompt}: {r.end} {r.status} {r.error}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out, failed


def check(results: list[StreamResult], refs: dict[tuple[str, int], Reference]) -> dict[str, Any]:
    """Every token each stream got against the reference of the versions it reported."""
    checked = wrong = unchecked = 0
    worst_ok_drift = 0.0
    examples: list[dict[str, Any]] = []
    for r in results:
        if not r.tokens:
            continue
        ref = refs.get((r.pinned() or "", r.prompt))
        if ref is None:
            unchecked += len(r.tokens)
            continue
        bad_at = None
        for i, (tok, lp) in enumerate(zip(r.tokens, r.logprobs, strict=True)):
            checked += 1
            if i >= len(ref.tokens):
                wrong += 1
                continue
            drift = abs(lp - ref.logprobs[i])
            if tok != ref.tokens[i] or drift > LOGPROB_TOL:
                wrong += 1
                bad_at = i if bad_at is None else bad_at
            else:
                worst_ok_drift = max(worst_ok_drift, drift)
        if bad_at is not None and len(examples) < 5:
            examples.append(
                {
                    "model": r.model,
                    "versions": r.versions,
                    "prompt": r.prompt,
                    "first_bad": bad_at,
                    "got": r.tokens[bad_at : bad_at + 3],
                    "got_lp": r.logprobs[bad_at : bad_at + 3],
                    "ref": ref.tokens[bad_at : bad_at + 3],
                    "ref_lp": ref.logprobs[bad_at : bad_at + 3],
                    "end": r.end,
                }
            )
    return {
        "tokens_checked": checked,
        "tokens_wrong": wrong,
        "tokens_unchecked": unchecked,
        "max_logprob_drift_of_matching_tokens": worst_ok_drift,
        "wrong_examples": examples,
    }


def distinguishable(refs: dict[tuple[str, int], Reference]) -> float:
    """Share of pairs of distinct references on one prompt that differ (text or logprob), i.e.
    how surely a wrong adapter would be caught: 1.0 = every version is told apart."""
    by_prompt: dict[int, list[Reference]] = {}
    for (_, prompt), ref in refs.items():
        by_prompt.setdefault(prompt, []).append(ref)
    pairs = differ = 0
    for group in by_prompt.values():
        for i in range(len(group)):
            for j in range(i + 1, len(group)):
                pairs += 1
                a, b = group[i], group[j]
                n = min(len(a.tokens), len(b.tokens))
                differ += any(
                    a.tokens[k] != b.tokens[k] or abs(a.logprobs[k] - b.logprobs[k]) > LOGPROB_TOL
                    for k in range(n)
                )
    return round(differ / pairs, 4) if pairs else 1.0
