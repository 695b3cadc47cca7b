"""The endpoints and parameters vLLM users' tools call, on a served app (tiny model, real Ray):
/tokenize, /detokenize, /version, /ping, HEAD /health, /v1/models/{id} with max_model_len,
min_p, include_stop_str_in_output, stop_reason and chat_template_kwargs."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.deployments.serve_helpers import ROOT, openai_client

MESSAGES = [{"role": "user", "content": "Say something about numbers."}]


def _post(url: str, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def test_tokenize_prompt_and_detokenize_round_trip(app_url) -> None:
    text = "The quick brown fox jumps over 13 lazy dogs."
    got = _post(
        app_url, "/tokenize", {"model": "tiny-base", "prompt": text, "add_special_tokens": False}
    )
    assert got.status_code == 200, got.text
    body = got.json()
    assert body["count"] == len(body["tokens"]) > 5
    assert body["max_model_len"] == 256
    back = _post(app_url, "/detokenize", {"model": "tiny-base", "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    # a prefix of the ids, as vLLM's benchmark cuts prompts to length
    cut = _post(app_url, "/detokenize", {"model": "math", "tokens": body["tokens"][:4]}).json()
    again = _post(app_url, "/tokenize", {"prompt": cut["prompt"], "add_special_tokens": False})
    assert again.json()["tokens"] == body["tokens"][:4]
    strs = _post(app_url, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert len(strs["token_strs"]) == strs["count"]


def test_tokenize_messages_counts_what_generation_counts(app_url) -> None:
    client = openai_client(app_url)
    done = client.chat.completions.create(model="code", messages=MESSAGES, max_tokens=2)
    got = _post(app_url, "/tokenize", {"model": "code", "messages": MESSAGES})
    assert got.status_code == 200, got.text
    assert got.json()["count"] == done.usage.prompt_tokens
    bare = _post(
        app_url, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}
    ).json()
    assert bare["count"] < done.usage.prompt_tokens


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "exactly one"),
        ("/tokenize", {}, 400, "exactly one"),
        ("/tokenize", {"prompt": "a", "model": "no-such-adapter"}, 404, "does not exist"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "chat_template_kwargs": {"x": 1}}, 400, "messages only"),
        (
            "/tokenize",
            {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}},
            400,
            "may not set",
        ),
        ("/tokenize", {"prompt": "a", "bogus": 1}, 400, "bogus"),
        ("/detokenize", {"tokens": [10**9]}, 400, "outside the vocabulary"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
def test_tokenize_bad_inputs_are_openai_errors(app_url, path, body, status, needle) -> None:
    got = _post(app_url, path, body)
    assert got.status_code == status, got.text
    assert needle in got.json()["error"]["message"]


def test_version_ping_and_head_health(app_url) -> None:
    version = httpx.get(f"{app_url}/version", timeout=30)
    assert version.status_code == 200 and version.json()["version"]
    for method in ("GET", "POST"):
        ping = httpx.request(method, f"{app_url}/ping", timeout=30)
        assert ping.status_code == 200 and ping.json()["status"] == "ok"
    head = httpx.head(f"{app_url}/health", timeout=30)
    assert head.status_code == 200 and head.content == b""


def test_model_by_id_and_max_model_len(app_url) -> None:
    client = openai_client(app_url)
    base = client.models.retrieve("tiny-base")
    assert base.id == "tiny-base" and base.model_extra["max_model_len"] == 256
    listed = {m.id: m.model_extra["max_model_len"] for m in client.models.list().data}
    assert listed["math"] == 256 and listed["mathcode"] == 256
    assert client.models.retrieve("mathcode").model_extra["molora"]["kind"] == "composition"
    for missing in ("no-such-model", "math:0.5+code:0.5", "math/code"):
        got = httpx.get(f"{app_url}/v1/models/{missing}", timeout=30)
        assert got.status_code == 404, got.text
        assert (
            got.json()["error"]["code"] == 404
            and "does not exist" in got.json()["error"]["message"]
        )


def test_stop_reason_and_include_stop_str_in_output(app_url) -> None:
    client = openai_client(app_url)
    full = client.completions.create(
        model="poem", prompt="Once upon a time", max_tokens=16, temperature=0
    )
    text = full.choices[0].text
    assert full.choices[0].finish_reason == "length"
    assert full.choices[0].model_extra["stop_reason"] is None
    stop = text[5:8]
    assert stop.strip(), text
    cut = text.find(stop)
    for include, want in ((False, text[:cut]), (True, text[: cut + len(stop)])):
        stopped = {
            "model": "poem",
            "prompt": "Once upon a time",
            "temperature": 0,
            "max_tokens": 16,
            "stop": [stop],
            "extra_body": {"include_stop_str_in_output": include},
        }
        got = client.completions.create(**stopped)
        choice = got.choices[0]
        assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
        assert choice.text == want
        streamed = client.completions.create(**stopped, stream=True)
        chunks = list(streamed)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert chunks[-1].choices[0].model_extra["stop_reason"] == stop


def test_min_p_one_is_greedy_and_bad_values_are_400(app_url) -> None:
    client = openai_client(app_url)
    greedy = client.chat.completions.create(
        model="math", messages=MESSAGES, max_tokens=8, temperature=0
    )
    strict = client.chat.completions.create(
        model="math",
        messages=MESSAGES,
        max_tokens=8,
        temperature=1.5,
        seed=3,
        extra_body={"min_p": 1.0},
    )
    assert strict.choices[0].message.content == greedy.choices[0].message.content
    for bad in (-0.1, 1.5, "0.5"):
        got = _post(
            app_url,
            "/v1/chat/completions",
            {"model": "math", "messages": MESSAGES, "min_p": bad, "max_tokens": 2},
        )
        assert got.status_code == 400 and got.json()["error"]["param"] == "min_p", got.text


def test_chat_template_kwargs_are_passed_and_bounded(app_url) -> None:
    client = openai_client(app_url)
    got = client.chat.completions.create(
        model="math",
        messages=MESSAGES,
        max_tokens=2,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert got.choices[0].finish_reason in ("stop", "length")
    for bad in ({"messages": []}, {"x": {"nested": 1}}, {f"k{i}": 1 for i in range(17)}):
        resp = _post(
            app_url,
            "/v1/chat/completions",
            {"model": "math", "messages": MESSAGES, "chat_template_kwargs": bad},
        )
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"].startswith("chat_template_kwargs")


# vLLM's venv beside the checkout (`make vllm-env`), or where MOLORA_VLLM_PYTHON points
VLLM_PYTHON = Path(os.environ.get("MOLORA_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
ALIGN = """
import asyncio, json, sys
from vllm.benchmarks.datasets.datasets import SampleRequest
from vllm.benchmarks.serve import _align_prompts_to_server_tokenizer
reqs = [SampleRequest(prompt=p, prompt_len=5, expected_output_len=1) for p in json.loads(sys.argv[2])]
out = asyncio.run(_align_prompts_to_server_tokenizer(sys.argv[1], "math", reqs))
print(json.dumps([r.prompt for r in out]))
"""


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vLLM's venv (make vllm-env) is absent")
def test_vllm_benchmark_client_aligns_through_tokenize(app_url) -> None:
    """vLLM's own benchmark code (unchanged) finds its 5-token prompts are longer on this
    server and cuts them through /tokenize and /detokenize."""
    prompts = ["one two three four five six seven eight", "the cat sat on the mat and purred"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [str(VLLM_PYTHON), "-c", ALIGN, app_url, json.dumps(prompts)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "re-aligning prompts" in run.stdout and "unavailable" not in run.stdout
    aligned = json.loads(run.stdout.strip().splitlines()[-1])
    for before, after in zip(prompts, aligned, strict=True):
        ids = _post(app_url, "/tokenize", {"prompt": before, "add_special_tokens": False}).json()
        assert (
            after == _post(app_url, "/detokenize", {"tokens": ids["tokens"][:5]}).json()["prompt"]
        )
        assert after != before and before.startswith(after)
