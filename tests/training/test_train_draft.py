"""`molora train draft` on a tiny chat model: it answers reasoning-gym prompts, trains a draft
head, and writes one the engine loads (safetensors + JSON + card); tuning it further adds to its
record; malformed options are refused before anything runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deployments.ops.cli import main as molora
from molora_runtime.engine.speculation.draft_head import CONFIG_FILE, WEIGHTS_FILE, load_head
from molora_runtime.model.loader import load_model
from molora_runtime.model.model_paths import ModelNotFoundError, resolve_model_path
from molora_runtime.model.tiny import make_tiny_model


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> Path:
    try:
        resolve_model_path("smollm2-135m-instruct")  # the tokenizer it borrows
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    return make_tiny_model(tmp_path_factory.mktemp("tiny-chat"), seed=7, with_tokenizer=True)


def train(model: Path, out: Path, *extra: str) -> int:
    return molora([
        "train", "draft", "--model", str(model), "--output", str(out), "--sequences", "6",
        "--max-tokens", "12", "--steps", "3", "--batch-size", "4", "--window", "4",
        "--domains", "arithmetic,sorting", "--threads", "1", *extra,
    ])  # fmt: skip


def test_the_cli_writes_a_head_the_engine_loads(tiny_chat: Path, tmp_path: Path) -> None:
    out = tmp_path / "head"
    assert train(tiny_chat, out) == 0
    assert {p.name for p in out.iterdir()} == {WEIGHTS_FILE, CONFIG_FILE, "README.md"}
    record = json.loads((out / CONFIG_FILE).read_text())
    assert (record["trained_sequences"], record["trained_steps"], record["window"]) == (6, 3, 4)
    lm = load_model(tiny_chat)
    head = load_head(out, lm)
    assert head.config.hidden_size == lm.arch.hidden_size
    draft = head.roll_out(lm, lm.norm(lm.embed_tokens.weight[5]), 7, 3)
    assert len(draft) == 3 and all(0 <= t < lm.arch.vocab_size for t in draft)
    assert "MoLoRA draft head (eagle)" in (out / "README.md").read_text()

    tuned = tmp_path / "tuned"
    assert train(tiny_chat, tuned, "--init-from", str(out)) == 0
    record = json.loads((tuned / CONFIG_FILE).read_text())
    assert (record["trained_sequences"], record["trained_steps"]) == (12, 6)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--adapter", "no-equals-sign"], "must be NAME=PEFT_FOLDER"),
        (["--domains", "astrology"], "unknown domain 'astrology'"),
        (["--window", "1"], "window"),
    ],
)
def test_bad_options_are_refused(tiny_chat: Path, tmp_path: Path, extra, says) -> None:
    with pytest.raises((SystemExit, ValueError)) as err:
        train(tiny_chat, tmp_path / "never", *extra)
    assert says in str(err.value)
    assert not (tmp_path / "never").exists()
