"""Tool calling end to end (real Ray, engine, tiny random model) as the official `openai` SDK,
LangChain (`bind_tools`, `with_structured_output(method="function_calling")`) and LiteLLM send
it: forced calls on every route kind, whole and streamed in OpenAI's delta shape; tool history
through the shipped Hermes template; and a model whose template has no tool format answering
`auto` with a 400 that says why. A random model never chooses to call by itself, so `auto`
parsing is proven by the unit tests (test_tool_call_units.py) on the template's own text."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.deployments.serve_helpers import deployed, openai_client, serving, shipped_args
from tests.support.tool_schemas import SCHEMAS, TOOLS

ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
ROUTES = ["tiny-base", "math", "math:0.5+code:0.5", "mathcode"]


@pytest.fixture(scope="module")
def app_url(ray_cluster, tiny_assets):
    args = shipped_args(
        tiny_assets,
        engine={"max_num_seqs": 4, "max_model_len": 1024, "chat_template": "hermes"},
        server={"default_max_tokens": 200},
    )
    yield from serving(ray_cluster, args, replicas=1, max_ongoing=16)


def _check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("model", ROUTES)
def test_required_call_on_every_route_kind(client, model) -> None:
    resp = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=1.0, seed=3, n=2,
    )  # fmt: skip
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        _check_call(call.function.name, call.function.arguments)
    # Streamed: the first delta of the call names it, later ones carry arguments text.
    stream = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=0, stream=True,
    )  # fmt: skip
    deltas, finish = [], None
    for chunk in stream:
        for ch in chunk.choices:
            deltas.extend(ch.delta.tool_calls or [])
            assert not ch.delta.content
            finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    arguments = "".join(d.function.arguments or "" for d in deltas)
    _check_call(first.function.name, arguments)
    whole = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=0,
    )  # fmt: skip
    call = whole.choices[0].message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == (first.function.name, arguments)


def test_named_function_and_parallel_calls(client) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    resp = client.chat.completions.create(
        model="code", messages=ASK, tools=TOOLS, tool_choice=named, temperature=1.0, seed=1
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"  # as OpenAI answers a forced function
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time"
    _check_call("get_time", call.function.arguments)
    resp = client.chat.completions.create(
        model="math", messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0,
        seed=2, n=3, max_tokens=300,
    )  # fmt: skip
    for choice in resp.choices:  # one or more calls; a random model may call until max_tokens
        assert choice.finish_reason in ("tool_calls", "length")
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            if choice.finish_reason == "tool_calls":
                _check_call(call.function.name, call.function.arguments)


def test_auto_and_history_go_through_the_template(client, tiny_assets) -> None:
    """`auto` from a random model: text (it does not call); the history's calls and results are
    rendered by the Hermes template, token for token what the server counted."""
    from transformers import AutoTokenizer

    from molora_runtime.model.chat_templates import use_chat_template

    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": '{"sky": "clear"}'},
    ]
    resp = client.chat.completions.create(
        model="poem", messages=history, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert resp.choices[0].finish_reason in ("stop", "length")
    tok = AutoTokenizer.from_pretrained(str(tiny_assets["model"]))
    use_chat_template(tok, "hermes", "tiny")
    for_template = [dict(m) for m in history]
    for_template[1] = {**history[1], "content": ""}
    for_template[1]["tool_calls"] = [
        {
            **history[1]["tool_calls"][0],
            "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}},
        }
    ]
    text = tok.apply_chat_template(
        for_template, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert '<tool_response>\n{"sky": "clear"}\n</tool_response>' in text
    assert resp.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))
    none = client.chat.completions.create(
        model="poem", messages=history, tools=TOOLS, tool_choice="none", max_tokens=4
    )
    assert none.choices[0].message.tool_calls is None


def test_langchain_bind_tools_and_structured_output(app_url) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "Oslo"], days: int = Field(ge=1, le=7)) -> str:
        """The weather in a city for some days."""
        return "clear"

    llm = ChatOpenAI(
        base_url=f"{app_url}/v1", api_key="unused", model="mathcode", max_retries=0,
        temperature=0.7, seed=5, max_tokens=200,
    )  # fmt: skip
    bound = llm.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False)
    msg = bound.invoke("Weather in Oslo for two days?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    assert call["args"]["city"] in ("Paris", "Oslo") and 1 <= call["args"]["days"] <= 7
    chunks = list(bound.stream("Weather in Paris?"))
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    assert merged.tool_calls and merged.tool_calls[0]["name"] == "get_weather"

    class Forecast(BaseModel):
        """A forecast to report."""

        sky: Literal["clear", "rain", "snow"]
        degrees: int = Field(ge=-40, le=40)

    out = llm.with_structured_output(Forecast, method="function_calling").invoke("Oslo?")
    assert isinstance(out, Forecast) and -40 <= out.degrees <= 40


def test_litellm_tools(app_url, monkeypatch) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import
    import litellm

    resp = litellm.completion(
        model="openai/math", api_base=f"{app_url}/v1", api_key="unused", messages=ASK,
        tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=200,
        num_retries=0,
    )  # fmt: skip
    (call,) = resp.choices[0].message.tool_calls
    _check_call(call.function.name, call.function.arguments)
    assert resp.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"functions": [{"name": "f"}]}, "deprecated functions API is not supported"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}],
             "tool_choice": "required"},
            "invalid tool parameters schema",
        ),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400(app_url, body, says) -> None:
    r = httpx.post(
        f"{app_url}/v1/chat/completions",
        json={"model": "math", "messages": ASK, **body},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]


def test_template_without_tool_format(ray_cluster, tiny_assets) -> None:
    """The tiny model's own ChatML has no tool format: `auto` is a 400 saying why, a forced call
    still works (the grammar makes it)."""
    args = shipped_args(
        tiny_assets, engine={"max_model_len": 1024}, server={"default_max_tokens": 200}
    )
    with deployed(ray_cluster["url"], args, replicas=1, max_ongoing=8):
        url = ray_cluster["url"]
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "math", "messages": ASK, "tools": TOOLS},
            timeout=60,
        )
        assert r.status_code == 400
        assert "no tool format" in r.json()["error"]["message"]
        assert "--chat-template" in r.json()["error"]["message"]
        resp = openai_client(url).chat.completions.create(
            model="math", messages=ASK, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False,
        )  # fmt: skip
        call = resp.choices[0].message.tool_calls[0]
        _check_call(call.function.name, call.function.arguments)
