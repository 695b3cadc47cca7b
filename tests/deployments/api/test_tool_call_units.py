"""Tool calling without a cluster: the Hermes parser on text the shipped template writes (whole
and fed in every split, same calls either way), the Shaper's tool hook, and the request payloads
(tool messages, tool_choice checks, OpenAI parameters we do not implement named as such)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from deployments.api.http_errors import validation_message
from deployments.api.request_models import ChatCompletionRequest, CompletionRequest
from deployments.api.response_shape import ResponseShape
from deployments.api.tool_calls import ToolCallShaping, ToolCallStream, parse_tool_calls
from deployments.catalog.model_names import Resolved
from molora_runtime.model.chat_templates import read_chat_template
from molora_runtime.routes import BaseRoute

CALLS = [
    ("get_weather", {"city": "Paris", "when": {"day": "Mon}"}, "units": ["C"]}),
    ("get_time", {}),
]


def _assistant_turn(calls, content: str = "") -> str:
    """What the shipped Hermes template writes for an assistant turn making `calls`: the exact
    text a model trained on it generates."""
    from jinja2 import Environment

    env = Environment()
    env.filters["tojson"] = lambda v: json.dumps(v, ensure_ascii=False)
    message = {
        "role": "assistant",
        "content": content,
        "tool_calls": [{"function": {"name": n, "arguments": a}} for n, a in calls],
    }
    text = env.from_string(read_chat_template("hermes")).render(
        messages=[{"role": "system", "content": "s"}, message], add_generation_prompt=False
    )
    turn = text.split("<|im_start|>assistant", 1)[1]
    return turn.removeprefix("\n").removesuffix("<|im_end|>\n")


def _streamed(text: str, step: int, max_calls: int | None = None):
    stream, content, calls = ToolCallStream(max_calls), "", {}
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for k, piece in enumerate(pieces):
        got, deltas = stream.feed(piece, last=k == len(pieces) - 1)
        content += got
        for d in deltas:
            if "id" in d:  # a call's first delta: index, id, type, name, arguments' start
                assert d["index"] == len(calls) and d["type"] == "function"
                calls[d["index"]] = [d["function"]["name"], d["function"]["arguments"]]
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]][1] += d["function"]["arguments"]
    return content, [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("step", [1, 2, 3, 5, 8, 13, 10_000])
def test_streamed_calls_equal_whole_ones(step) -> None:
    text = _assistant_turn(CALLS, content="Let me look.")
    assert text.startswith("Let me look.\n<tool_call>\n{")
    content, calls = parse_tool_calls(text)
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == CALLS
    assert [c["index"] for c in calls] == [0, 1]
    assert len({c["id"] for c in calls}) == 2
    s_content, s_calls = _streamed(text, step)
    assert s_content.strip() == content
    assert s_calls == [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_qwen3_form_and_text_after_calls() -> None:
    """Qwen3 writes the same blocks (after its think block); text after the calls is content."""
    text = '<think>\nok\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\nDone.'
    content, calls = parse_tool_calls(text)
    assert content == "<think>\nok\n</think>\n\nDone."
    assert calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert _streamed(text, 4)[0] == "<think>\nok\n</think>\n\nDone."


@pytest.mark.parametrize(
    "text",
    [
        "no calls at all, a < sign and <tool",
        "<tool_call>\n{not json}\n</tool_call> after",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',  # arguments not an object
        '<tool_call>\n{"name": "f", "argum',  # cut by max_tokens
    ],
)
def test_what_is_no_call_stays_content(text) -> None:
    assert parse_tool_calls(text) == (text, [])
    for step in (1, 4, 10_000):
        assert _streamed(text, step) == (text, [])


def test_key_order_and_max_calls() -> None:
    text = '<tool_call>\n{"arguments": {"x": "y"}, "name": "g"}\n</tool_call>\n' * 3
    content, calls = parse_tool_calls(text, max_calls=1)
    assert content == "" and len(calls) == 1
    assert calls[0]["function"] == {"name": "g", "arguments": '{"x": "y"}'}
    for step in (1, 7, 10_000):
        assert _streamed(text, step, max_calls=1) == ("", [("g", '{"x": "y"}')])


def _hook(mode: str, parallel: bool = True, chat: bool = True) -> ToolCallShaping | None:
    """The shaping hook of a real request with tool_choice `mode` ("named": a named function)."""
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    choice = choice if mode == "named" else mode
    body: Any
    if chat:
        body = ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
             "tool_choice": choice, "parallel_tool_calls": parallel}
        )  # fmt: skip
    else:
        body = CompletionRequest.model_validate({"model": "m", "prompt": "hi"})
    resolved = Resolved(route=BaseRoute(), placement_adapters=())
    return ToolCallShaping.for_shape(ResponseShape.of(body, resolved, chat, "chatcmpl-1"))


def test_shaping_hook_finish_reasons_and_null_content() -> None:
    assert _hook("none") is None
    assert _hook("auto", chat=False) is None
    text = _assistant_turn(CALLS[:1])
    for mode, finish in (("auto", "tool_calls"), ("required", "tool_calls"), ("named", "stop")):
        hook = _hook(mode)
        content, calls, why = hook.message(text, "stop")
        assert content is None and why == finish and calls[0].function.name == "get_weather"
        assert hook.message("plain words", "stop") == ("plain words", None, "stop")
        assert hook.message(text, "length")[2] == "length"
        content, deltas, why = hook.delta(0, text, "stop")
        assert content is None and why == finish and deltas[0]["id"].startswith("call_")
    hook = _hook("auto", parallel=False)
    assert len(hook.message(_assistant_turn(CALLS), "stop")[1]) == 1


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
USER = {"role": "user", "content": "hi"}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


def _check(body: dict) -> str | ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate({"model": "m", **body})
    except ValidationError as exc:
        return validation_message(exc)[0]


def test_tool_history_reaches_the_template_in_its_shape() -> None:
    req = _check(
        {
            "messages": [
                USER,
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": "3"},
            ],
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "parallel_tool_calls": False,
        }
    )
    assert isinstance(req, ChatCompletionRequest)
    assert req.has_tool_history() and req.tool_mode() == "named"
    assert req.engine_messages()[1:] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
            ],
        },
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
    ]
    assert req.engine_format() == {
        "type": "tool_calls",
        "tool_calls": {
            "functions": [{"name": "f", "parameters": {"type": "object"}}],
            "parallel": False,
        },
    }
    assert req.template_tools() == TOOLS


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "'g', which is not in tools",
        ),
        ({"tools": TOOLS * 2}, "names must be unique"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            },
            "of type 'object'",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "has space"}}]},
            "tools.0.function.name",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "cannot be combined",
        ),
        ({"messages": [USER, {"role": "tool", "content": "3"}]}, "tool_call_id"),
        ({"messages": [USER, {"role": "assistant", "content": None}]}, "null only with tool_calls"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "only assistant"),
        (
            {"functions": [{"name": "f"}]},
            "functions: the deprecated functions API is not supported",
        ),
        ({"function_call": "auto"}, "not supported; send tool_choice"),
        ({"audio": {}}, "audio: audio output is not supported"),
        ({"messages": [{**USER, "refusal": "no"}]}, "messages.0.refusal: assistant refusals"),
        ({"frobnicate": 1}, "frobnicate: unknown parameter"),
    ],
)
def test_bad_tool_requests_say_why(body, says) -> None:
    got = _check({"messages": [USER], **body})
    assert isinstance(got, str) and says in got, got


def test_openai_parameters_at_their_neutral_value_are_accepted() -> None:
    neutral = {"store": False, "metadata": None, "service_tier": "auto", "modalities": ["text"]}
    assert isinstance(_check({"messages": [USER], **neutral}), ChatCompletionRequest)
    assert "stored completions are not supported" in _check({"messages": [USER], "store": True})
    assert "service tiers are not supported" in _check({"messages": [USER], "service_tier": "flex"})
