"""Issue #17's parameters through the official client and raw HTTP (real Ray, engine, tiny model):
logprobs against transformers' own logits, n > 1 and best_of, penalties and logit_bias."""

from __future__ import annotations

import httpx
import pytest
import torch

MESSAGES = [{"role": "user", "content": "Say something."}]
PROMPT_IDS = [17, 4242, 318, 9, 1001, 77]


@pytest.fixture(scope="module")
def hf_model(tiny_assets):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(tiny_assets["model"]), dtype=torch.float32
    ).eval()


def _ref_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, -1]
    return torch.log_softmax(logits.float(), -1)


def test_completion_logprobs_match_the_models_log_softmax(client, hf_model, tiny_assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_assets["model"]))
    resp = client.completions.create(
        model="tiny-base", prompt=PROMPT_IDS, max_tokens=4, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    ids = list(tok.encode(resp.choices[0].text, add_special_tokens=False))
    generated: list[int] = []
    for t in range(4):
        ref = _ref_logprobs(hf_model, PROMPT_IDS + generated)
        top = torch.topk(ref, 3)
        best = int(top.indices[0])
        generated.append(best)
        assert lp.tokens[t] == tok.decode([best])
        assert lp.token_logprobs[t] == pytest.approx(float(ref[best]), abs=1e-4)
        want = {
            tok.decode([int(i)]): float(v) for i, v in zip(top.indices, top.values, strict=True)
        }
        assert lp.top_logprobs[t] == pytest.approx(want, abs=1e-4)
    assert ids == generated or tok.decode(generated) == resp.choices[0].text
    assert lp.text_offset == [sum(len(s) for s in lp.tokens[:i]) for i in range(4)]


def test_chat_logprobs_streamed_and_not(client):
    kw = dict(
        model="math", messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    full = client.chat.completions.create(**kw)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens == 5
    assert "".join(c.token for c in content) == full.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.logprob == pytest.approx(c.top_logprobs[0].logprob)  # greedy: the best token
        assert c.bytes == list(c.token.encode())
    streamed = [
        e
        for chunk in client.chat.completions.create(**kw, stream=True)
        for ch in chunk.choices
        if ch.logprobs is not None
        for e in ch.logprobs.content or []
    ]
    # The second request finds the prompt's blocks in the prefix cache and prefills only the
    # rest: other GEMM shapes, so the same logprobs can differ in the last float bits.
    assert [e.token for e in streamed] == [c.token for c in content]
    assert [e.logprob for e in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)
    plain = client.chat.completions.create(model="math", messages=MESSAGES, max_tokens=3)
    assert plain.choices[0].logprobs is None


def test_n_choices_are_seeded_and_reproducible(client):
    kw = dict(
        model="code", messages=MESSAGES, max_tokens=8, temperature=1.0, n=3, seed=11,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]
    assert len(set(texts)) > 1  # each choice has its own seed stream
    assert a.usage.completion_tokens == 24
    # Choice i is what n=1 gives with seed 11 + i.
    one = client.chat.completions.create(**{**kw, "n": 1, "seed": 12})
    assert one.choices[0].message.content == texts[1]
    # Streamed: every chunk names its choice; per choice the same text.
    got: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            got[ch.index] = got.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert [got[i] for i in range(3)] == texts
    assert finishes == {0: "length", 1: "length", 2: "length"}


def test_best_of_returns_the_most_likely_choices(client):
    resp = client.completions.create(
        model="poem", prompt="Once upon", max_tokens=6, temperature=1.0, n=2, best_of=4, seed=3,
        logprobs=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in resp.choices] == [0, 1]
    means = [sum(c.logprobs.token_logprobs) / 6 for c in resp.choices]
    assert means[0] >= means[1]
    assert resp.usage.completion_tokens == 24  # every sample drawn counts
    single = client.completions.create(
        model="poem", prompt="Once upon", max_tokens=6, temperature=1.0, best_of=4, seed=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert single.choices[0].text == resp.choices[0].text
    assert single.choices[0].logprobs is None  # not asked: only used to rank


def test_logit_bias_and_penalties_through_the_api(client):
    def tokens(**kw) -> list[str]:
        resp = client.completions.create(
            model="tiny-base", prompt=PROMPT_IDS, max_tokens=8, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True, **kw.pop("extra", {})}, **kw,
        )  # fmt: skip
        return resp.choices[0].logprobs.tokens

    forced = tokens(logit_bias={"4242": 100})
    assert len(set(forced)) == 1 and len(forced) == 8
    assert tokens(logit_bias={"4242": 1.0}, presence_penalty=2.0).count(forced[0]) <= 1
    assert tokens(logit_bias={"4242": 5.0}, frequency_penalty=2.0).count(forced[0]) <= 3
    assert tokens(logit_bias={"4242": 1.0}, extra={"repetition_penalty": 10.0}).count(forced[0]) < 8


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"n": 17}, "n"),
        ({"best_of": 1, "n": 2}, None),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_bad_parameters_are_400s(app_url, body, param):
    r = httpx.post(
        f"{app_url}/v1/completions",
        json={"model": "tiny-base", "prompt": "x", "max_tokens": 2, **body},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


def test_out_of_vocab_bias_and_top_logprobs_without_logprobs(app_url):
    r = httpx.post(
        f"{app_url}/v1/completions",
        json={"model": "tiny-base", "prompt": "x", "logit_bias": {"9999999": 1}},
        timeout=30,
    )
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    r = httpx.post(
        f"{app_url}/v1/chat/completions",
        json={"model": "tiny-base", "messages": MESSAGES, "top_logprobs": 2},
        timeout=30,
    )
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"]


SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["ok", "color"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("model", ["tiny-base", "math", "math:0.5+code:0.5", "mathcode"])
def test_json_schema_output_validates_on_every_route_kind(client, model):
    import json

    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    resp = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=60, temperature=1.0, seed=5, n=2,
        response_format=fmt,
    )  # fmt: skip
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=60, temperature=0, response_format=fmt,
        stream=True,
    )  # fmt: skip
    streamed = "".join(ch.delta.content or "" for chunk in stream for ch in chunk.choices)
    jsonschema.validate(json.loads(streamed), SCHEMA)


def test_json_object_and_bad_schemas(app_url, client):
    resp = client.completions.create(
        model="code", prompt="JSON:", max_tokens=40, temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )  # fmt: skip
    assert resp.choices[0].text.lstrip().startswith("{")
    for fmt, where in [
        ({"type": "json_schema", "json_schema": {"schema": {"type": "frobnicate"}}}, "schema"),
        ({"type": "json_schema"}, "response_format"),
        ({"type": "yaml"}, "response_format"),
    ]:
        r = httpx.post(
            f"{app_url}/v1/chat/completions",
            json={"model": "math", "messages": MESSAGES, "response_format": fmt},
            timeout=30,
        )
        assert r.status_code == 400, r.text
        assert where in r.json()["error"]["message"]


def test_echo_with_prompt_logprobs(client, hf_model, tiny_assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_assets["model"]))
    resp = client.completions.create(
        model="tiny-base", prompt=PROMPT_IDS, max_tokens=3, temperature=0, logprobs=2, echo=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = resp.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(PROMPT_IDS) + 3
    assert lp.tokens[: len(PROMPT_IDS)] == [tok.decode([t]) for t in PROMPT_IDS]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([PROMPT_IDS])).logits[0].float(), -1)
    for pos in range(1, len(PROMPT_IDS)):
        assert lp.token_logprobs[pos] == pytest.approx(
            float(ref[pos - 1, PROMPT_IDS[pos]]), abs=1e-4
        )
        assert len(lp.top_logprobs[pos]) <= 2
    prompt_text = "".join(lp.tokens[: len(PROMPT_IDS)])
    assert choice.text.startswith(prompt_text)
    assert lp.text_offset[len(PROMPT_IDS)] == len(prompt_text)
    plain = client.completions.create(
        model="math", prompt="Once upon", max_tokens=3, temperature=0, echo=True, n=2
    )
    assert all(c.text.startswith("Once upon") and c.logprobs is None for c in plain.choices)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="math", prompt="Once upon", max_tokens=3, temperature=0, echo=True, stream=True
        )
        if c.choices
    )
    assert streamed == plain.choices[0].text
