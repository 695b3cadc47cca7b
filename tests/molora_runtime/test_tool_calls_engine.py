"""Tool calls in the engine: forced calls (a grammar) from a random tiny model are valid calls of
an offered function with arguments matching its schema; chat templates render tools and tool-call
history (the shipped Hermes template), and a template without a tool format is refused by name."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from molora_runtime.engine.structured.response_format import ResponseFormat
from molora_runtime.engine.types import GenerationRequest, SamplingParams
from molora_runtime.errors import InvalidRequestError
from molora_runtime.model.chat_templates import (
    ChatTemplateError,
    read_chat_template,
    renders_tools,
    use_chat_template,
)
from tests.molora_runtime.rt_util import build_engine, run_to_completion
from tests.support.tool_schemas import CLOCK, SCHEMAS, TOOLS

BLOCK = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)


@pytest.fixture(scope="module")
def engines(tiny_chat_model):
    """The model's own template (SmolLM2's ChatML, no tools) and the shipped Hermes one."""
    return {
        name: build_engine(tiny_chat_model, chat_template=template, max_model_len=1024)
        for name, template in (("plain", None), ("hermes", "hermes"))
    }


def _forced(rid: str, names: list[str], parallel: bool, **sampling) -> GenerationRequest:
    fmt = ResponseFormat(
        type="tool_calls",
        tool_calls={
            "functions": [{"name": n, "parameters": SCHEMAS[n]} for n in names],
            "parallel": parallel,
        },
    )
    return GenerationRequest(
        request_id=rid,
        messages=[{"role": "user", "content": "What is the weather?"}],
        tools=TOOLS,
        sampling=SamplingParams(max_tokens=160, **sampling),
        response_format=fmt,
    )


def _calls(text: str, cut: bool = False) -> list[dict]:
    """Every block of `text`, which must be nothing but blocks separated by newlines (`cut`: and
    the start of one more, where max_tokens ended the output)."""
    blocks = BLOCK.findall(text)
    rest = BLOCK.sub("", text).strip("\n")
    assert rest == "" or (cut and rest.startswith("<tool_call>\n{")), text
    return [json.loads(b) for b in blocks]


@pytest.mark.parametrize("template", ["plain", "hermes"])
@pytest.mark.parametrize("parallel", [False, True])
def test_required_tool_calls_are_valid_calls(engines, template, parallel) -> None:
    reqs = [
        _forced(f"r{i}", list(SCHEMAS), parallel, temperature=1.0, seed=20 + i) for i in range(4)
    ]
    got = run_to_completion(engines[template], reqs)
    counts = []
    for res in got.values():
        # With parallel calls a random model may go on calling until max_tokens.
        assert res["finish_reason"] == "stop" or parallel, res
        calls = _calls(res["text"], cut=res["finish_reason"] == "length")
        counts.append(len(calls))
        for call in calls:
            assert set(call) == {"name", "arguments"}
            jsonschema.validate(call["arguments"], SCHEMAS[call["name"]])
    assert min(counts) >= 1
    if not parallel:
        assert counts == [1, 1, 1, 1]


def test_named_function_is_the_one_called(engines) -> None:
    got = run_to_completion(
        engines["hermes"], [_forced(f"n{i}", ["get_time"], False, seed=i) for i in range(2)]
    )
    for res in got.values():
        (call,) = _calls(res["text"])
        assert call["name"] == "get_time"
        jsonschema.validate(call["arguments"], CLOCK)


def test_bad_parameters_schema_is_refused_before_queueing(engines) -> None:
    fmt = ResponseFormat(
        type="tool_calls",
        tool_calls={"functions": [{"name": "f", "parameters": {"type": "frobnicate"}}]},
    )
    req = GenerationRequest(
        request_id="bad", messages=[{"role": "user", "content": "x"}], response_format=fmt
    )
    with pytest.raises(InvalidRequestError, match="invalid tool parameters schema"):
        engines["plain"].add_request(req)
    assert not engines["plain"].has_work()


HISTORY = [
    {"role": "system", "content": "You check the weather."},
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
]


def test_hermes_template_renders_tools_calls_and_results(engines) -> None:
    engine = engines["hermes"]
    req = GenerationRequest(request_id="h", messages=HISTORY, tools=TOOLS, needs_tool_format=True)
    text = engine.tokenizer.decode(engine.checker.encode_prompt(req))
    assert "<tools>\n" + json.dumps(TOOLS[0]) in text
    assert "You check the weather.\n\n# Tools" in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Oslo", "days": 2}}\n</tool_call><|im_end|>' in text
    )
    assert '<|im_start|>tool\n<tool_response>\n{"sky": "clear"}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_template_without_tool_format_is_refused_by_name(engines) -> None:
    req = GenerationRequest(request_id="p", messages=HISTORY, tools=TOOLS, needs_tool_format=True)
    with pytest.raises(InvalidRequestError, match="no tool format"):
        engines["plain"].add_request(req)
    assert not renders_tools(engines["plain"].tokenizer)
    assert renders_tools(engines["hermes"].tokenizer)


def test_hermes_template_without_tools_renders_as_smollm2(tiny_chat_model) -> None:
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(str(tiny_chat_model))
    ours = AutoTokenizer.from_pretrained(str(tiny_chat_model))
    use_chat_template(ours, "hermes", "any")
    for messages in (
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}],
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ],
    ):
        for gen in (True, False):
            kw = {"add_generation_prompt": gen, "tokenize": False}
            assert own.apply_chat_template(messages, **kw) == ours.apply_chat_template(
                messages, **kw
            )


def test_chat_template_choices(tmp_path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert read_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert read_chat_template("{{ 'inline' }}") == "{{ 'inline' }}"
    assert "<tool_call>" in read_chat_template("hermes")
    with pytest.raises(ChatTemplateError, match="neither a shipped template"):
        read_chat_template("no-such-template")
