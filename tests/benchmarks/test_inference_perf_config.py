"""benchmarks/inference_perf.yaml is a config inference-perf accepts (Zipf split over the 64
benchmark adapters, summing to exactly 1.0 as it demands), and the request bodies inference-perf
and `vllm bench serve --lora-modules` send are ones our /v1/completions accepts."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from deployments.api.request_models import CompletionRequest

CONFIG = Path(__file__).resolve().parents[2] / "benchmarks" / "inference_perf.yaml"
ADAPTERS = [f"ad{i:05d}" for i in range(64)]


def _config() -> dict:
    return yaml.safe_load(CONFIG.read_text())


def test_split_names_the_64_adapters_with_zipf_weights() -> None:
    split = _config()["load"]["lora_traffic_split"]
    assert [entry["name"] for entry in split] == ADAPTERS
    weights = [entry["split"] for entry in split]
    # inference-perf's own check (LoadConfig.validate_load_config): the float sum, in order
    assert sum(weights) == 1.0
    harmonic = sum(Fraction(1, i) for i in range(1, 65))
    for i, weight in enumerate(weights, start=1):
        assert round(weight, 4) == weight  # 4 decimals
        assert abs(Fraction(weight) - Fraction(1, i) / harmonic) <= Fraction(1, 10_000), i
    assert weights == sorted(weights, reverse=True)


def test_config_targets_the_local_endpoint() -> None:
    config = _config()
    assert config["server"]["base_url"] == "http://127.0.0.1:8000"
    assert config["server"]["type"] == "vllm" and config["server"]["ignore_eos"] is True
    assert config["api"] == {"type": "completion", "streaming": True}
    assert config["load"]["type"] in ("constant", "poisson")
    assert all(s["rate"] > 0 and s["duration"] > 0 for s in config["load"]["stages"])


def test_inference_perf_request_body_is_accepted() -> None:
    """inference-perf's completion body (inference_perf/apis/completion.py `to_request_body`)."""
    body = {
        "model": "ad00000",
        "prompt": "a random prompt",
        "max_tokens": 64,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = CompletionRequest.model_validate(body)
    assert req.model == "ad00000" and req.ignore_eos and req.stream_options is not None


def test_vllm_bench_serve_lora_body_is_accepted() -> None:
    """`vllm bench serve --backend openai --lora-modules ...` (vLLM 0.32,
    benchmarks/lib/endpoint_request_func.py `async_request_openai_completions`): the LoRA name
    as `model`, its fixed fields, `--ignore-eos`, and the sampling flags it forwards."""
    body = {
        "model": "ad00042",
        "prompt": "a random prompt",
        "repetition_penalty": 1.0,
        "max_tokens": 128,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
    }
    req = CompletionRequest.model_validate(body)
    assert req.model == "ad00042" and req.logprobs is None and req.ignore_eos


@pytest.mark.parametrize("off", [0, -1])
def test_vllm_top_k_off_is_accepted_as_off(off: int) -> None:
    """`vllm bench serve --top-k -1` sends vLLM's "off"; it means no top-k here too."""
    body = {"model": "ad00042", "prompt": "p", "max_tokens": 4, "top_k": off}
    assert CompletionRequest.model_validate(body).top_k == 0
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({**body, "top_k": -2})
