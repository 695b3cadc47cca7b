"""`vocab` and `learned` routes equal a deliberately plain dense reference written only here.

The reference is the transformers model with PEFT's LoRA modules switched off
(`disable_adapter()`) plus hooks: at each decoder layer a forward pre-hook computes every token's
adapter weights w[t, k] (vocab: from the token's own input id; learned: top-k softmax of the
layer's gate on `input_layernorm(h)`, temperature, renormalised over the top-k), and a forward
hook on every target linear adds Σ_k w[t, k] · scale_k · B_k A_k x computed densely over ALL K
adapters. Greedy decoding recomputes the whole sequence every step (no cache)."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from molora_runtime.routes import LearnedRoute, VocabRoute
from tests.molora_runtime.rt_util import (
    engine_prefill_logits,
    random_prompts,
    request,
    run_to_completion,
)


class DenseReference:
    """Every adapter computed for every token, then weighted by `weights_fn(layer, ids, normed)`."""

    def __init__(self, pm, adapters: list[str], weights_fn) -> None:
        self.pm, self.adapters, self.weights_fn = pm, adapters, weights_fn
        self.w: torch.Tensor | None = None  # [T, K] of the current layer
        self.ids: torch.Tensor | None = None

    @contextmanager
    def hooks(self):
        from peft.tuners.lora import LoraLayer

        handles = []
        decoder = self.pm.base_model.model.model
        for i, layer in enumerate(decoder.layers):
            handles.append(layer.register_forward_pre_hook(self._layer_hook(i, layer)))
            for module in layer.modules():
                if isinstance(module, LoraLayer):
                    handles.append(module.register_forward_hook(self._delta_hook(module)))
        try:
            with self.pm.disable_adapter():
                yield
        finally:
            for h in handles:
                h.remove()

    def _layer_hook(self, i: int, layer):
        def hook(_module, args):
            normed = layer.input_layernorm(args[0])[0]  # [T, d]
            self.w = self.weights_fn(i, self.ids, normed)

        return hook

    def _delta_hook(self, module):
        def hook(_module, args, output):
            x = args[0][0]  # [T, d_in]
            delta = torch.zeros_like(output[0])
            for k, name in enumerate(self.adapters):
                A, B = module.lora_A[name].weight, module.lora_B[name].weight
                delta += self.w[:, k, None] * module.scaling[name] * (x @ A.t() @ B.t())
            return output + delta[None]

        return hook

    def logits(self, ids: list[int]) -> torch.Tensor:
        self.ids = torch.tensor(ids)
        with torch.no_grad(), self.hooks():
            return self.pm(torch.tensor([ids])).logits[0]

    def greedy(self, ids: list[int], n: int) -> list[int]:
        seq = list(ids)
        for _ in range(n):
            seq.append(int(self.logits(seq)[-1].argmax()))
        return seq[len(ids) :]


VOCAB = VocabRoute(
    ranges=[
        {"start": 0, "end": 70, "adapter": "a"},
        {"start": 70, "end": 140, "adapter": None},
        {"start": 140, "end": 200, "adapter": "c"},
    ],
    default="b",
)


def vocab_weights(_layer: int, ids: torch.Tensor, _normed: torch.Tensor) -> torch.Tensor:
    w = torch.zeros(len(ids), 3)  # adapters a, b, c
    for t, tok in enumerate(ids.tolist()):
        if tok < 70:
            w[t, 0] = 1
        elif tok < 140:
            pass  # base model
        elif tok < 200:
            w[t, 2] = 1
        else:
            w[t, 1] = 1  # default
    return w


def assert_engine_matches(engine, route, ref: DenseReference, prompts, new_tokens: int) -> None:
    """Prefill logits within 1e-4 of the reference, and the same greedy tokens."""
    for prompt in prompts:
        torch.testing.assert_close(
            engine_prefill_logits(engine, route, prompt), ref.logits(prompt), atol=1e-4, rtol=0
        )
    reqs = [request(f"r{i}", p, route, new_tokens) for i, p in enumerate(prompts)]
    got = run_to_completion(engine, reqs)
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"]["tokens"] == ref.greedy(prompt, new_tokens)


def test_vocab_route_equals_dense_reference(tiny_engine_factory, peft_abc) -> None:
    engine = tiny_engine_factory()
    ref = DenseReference(peft_abc, ["a", "b", "c"], vocab_weights)
    assert_engine_matches(engine, VOCAB, ref, random_prompts(3, 256, [14, 9, 20], seed=31), 10)


def learned_weights_fn(comp_folder: Path, top_k: int, temperature: float):
    gates = load_file(str(comp_folder / "gates.safetensors"))
    W, b = gates["gate.weight"], gates["gate.bias"]  # [L, K, d], [L, K]

    def fn(layer: int, _ids: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        logits = (normed @ W[layer].t() + b[layer]) / temperature
        vals, idx = logits.topk(top_k, dim=-1)
        w = torch.zeros_like(logits)
        return w.scatter(1, idx, torch.softmax(vals, dim=-1))

    return fn


@pytest.mark.parametrize(
    ("top_k", "temperature"),
    [(None, None), (1, None), (3, 0.5), (2, 3.0)],
    ids=["composition-defaults", "top1", "top3-cold", "top2-hot"],
)
def test_learned_route_equals_dense_reference(
    top_k, temperature, tiny_engine_factory, tiny_composition: Path, peft_abc
) -> None:
    cfg = json.loads((tiny_composition / "composition.json").read_text())
    assert cfg["adapters"] == ["a", "b", "c"]
    k, temp = top_k or cfg["top_k"], temperature or cfg["temperature"]
    ref = DenseReference(peft_abc, cfg["adapters"], learned_weights_fn(tiny_composition, k, temp))
    route = LearnedRoute(composition="moe", top_k=top_k, temperature=temperature)
    engine = tiny_engine_factory()
    assert_engine_matches(engine, route, ref, random_prompts(2, 256, [15, 8], seed=41), 8)


def test_learned_gates_really_route(tiny_composition: Path, peft_abc) -> None:
    """Sanity of the setup: with top-2 of 3 different tokens pick different expert pairs."""
    fn = learned_weights_fn(tiny_composition, 2, 0.7)
    seen = set()
    ref = DenseReference(peft_abc, ["a", "b", "c"], fn)

    def spy(layer, ids, normed):
        w = fn(layer, ids, normed)
        seen.update(tuple((row > 0).tolist()) for row in w)
        return w

    ref.weights_fn = spy
    ref.logits(random_prompts(1, 256, [40], seed=2)[0])
    assert len(seen) >= 2
