"""Per-request gate summaries through the real engine, against the forward's own per-token gates.

The reference is folded in plain Python, token by token, from what each step's forward really
computed (its per-layer slot tables and gate logits, read from the model runner's result), for
the row that produced each generated token; attribution gives a second, independent view of
the mean weights.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from molora_runtime.engine.llm import LLM
from molora_runtime.engine.types import GateSummary, SamplingParams
from molora_runtime.errors import InvalidRequestError
from molora_runtime.routes import LearnedRoute, MixRoute
from tests.molora_runtime.rt_util import (
    make_composition,
    random_prompts,
    request,
    run_to_completion,
)
from tests.molora_runtime.test_preemption import BS, budget


@pytest.fixture(scope="module")
def duo(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second composition (2 experts, top-1): with `moe` in one step, the general gate path."""
    out = tmp_path_factory.mktemp("duo") / "duo"
    return make_composition(tiny_llama, out, ["a", "b"], top_k=1, seed=11)


def capture_gates(engine: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[dict]]:
    """Wrap the model runner: per request, each generated token's per-layer gate rows."""
    seen: dict[str, list[dict]] = {}
    real = engine.runner.run

    def run(batch: Any) -> Any:
        result = real(batch)
        ctx = result.ctx
        for seq, row in zip(batch.logits_seqs, batch.logits_index, strict=True):
            if ctx is None or not isinstance(seq.route, LearnedRoute):
                continue
            seen.setdefault(seq.request_id, []).append(
                {
                    "slots": [t[0][row].tolist() for t in ctx.layer_tables],
                    "weights": [t[1][row].tolist() for t in ctx.layer_tables],
                    "logits": [lg[row].tolist() for lg in ctx.layer_logits],
                }
            )
        return result

    monkeypatch.setattr(engine.runner, "run", run)
    return seen


def reference(tokens: list[dict], expert_slots: list[int]) -> dict[str, Any]:
    """The summary folded token by token in plain Python."""
    n, L = len(expert_slots), len(tokens[0]["slots"])
    selected, weight, first = [0.0] * n, [0.0] * n, [[0.0] * n for _ in range(L)]
    entropy = 0.0
    for tok in tokens:
        for layer in range(L):
            for slot, w in zip(tok["slots"][layer], tok["weights"][layer], strict=True):
                if w > 0 and slot in expert_slots:
                    selected[expert_slots.index(slot)] += 1
                    weight[expert_slots.index(slot)] += w
            logits = tok["logits"][layer][:n]
            top = max(logits)
            probs = [math.exp(v - top) for v in logits]
            probs = [p / sum(probs) for p in probs]
            entropy += -sum(p * math.log(p) for p in probs if p > 0) / math.log(n)
            first[layer][logits.index(top)] += 1
    T = len(tokens)
    return {
        "share": [s / sum(selected) for s in selected],
        "mean_weight": [w / (T * L) for w in weight],
        "mean_entropy": entropy / (T * L),
        "layer_top1_share": [[c / T for c in row] for row in first],
    }


def check(summary: GateSummary, want: dict[str, Any], tokens: int, layers: bool) -> None:
    assert summary.tokens == tokens
    assert summary.share == pytest.approx(want["share"], abs=1e-5)
    assert summary.mean_weight == pytest.approx(want["mean_weight"], abs=1e-5)
    assert summary.mean_entropy == pytest.approx(want["mean_entropy"], abs=1e-5)
    assert sum(summary.share) == pytest.approx(1.0, abs=1e-5)
    assert sum(summary.mean_weight) == pytest.approx(1.0, abs=1e-5)
    assert 0.0 <= summary.mean_entropy <= 1.0
    if not layers:
        assert summary.layer_top1_share is None
        return
    assert summary.layer_top1_share is not None
    assert len(summary.layer_top1_share) == summary.layers
    for got, expected in zip(summary.layer_top1_share, want["layer_top1_share"], strict=True):
        assert sum(got) == pytest.approx(1.0, abs=1e-5)
        assert got == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("path", ["one composition", "two compositions"])
def test_summary_matches_the_per_token_gates(
    path: str, tiny_engine_factory, tiny_composition: Path, duo: Path, monkeypatch
) -> None:
    engine = tiny_engine_factory(compositions={"moe": tiny_composition, "duo": duo})
    seen = capture_gates(engine, monkeypatch)
    prompts = random_prompts(4, 256, [5, 11, 7], seed=21)
    summary = {"return_gate_summary": True}
    reqs = [
        request("full", prompts[0], LearnedRoute(composition="moe"), 7,
                gate_summary_layers=True, return_attribution=True, **summary),
        request("top1", prompts[1], LearnedRoute(composition="moe", top_k=1), 5, **summary),
        request("quiet", prompts[2], LearnedRoute(composition="moe"), 4),
        request("static", prompts[3], MixRoute(weights={"a": 0.5, "c": 0.5}), 4),
    ]  # fmt: skip
    if path == "two compositions":
        reqs.append(request("duo", prompts[3], LearnedRoute(composition="duo"), 6, **summary))
    results = run_to_completion(engine, reqs)
    for rid in ("quiet", "static"):
        assert results[rid]["outputs"][-1].gate_summary is None
    asked = {"full": (7, True), "top1": (5, False)}
    if path == "two compositions":
        asked["duo"] = (6, False)
    for rid, (tokens, layers) in asked.items():
        got = results[rid]["outputs"][-1].gate_summary
        assert got is not None and all(o.gate_summary is None for o in results[rid]["outputs"][:-1])
        comp = next(r.route.composition for r in reqs if r.request_id == rid)
        assert got.composition == comp
        assert got.experts == engine.hot_set.composition_info(comp).experts
        assert got.layers == engine.arch.num_layers
        want = reference(seen[rid], engine.hot_set.expert_slots(comp))
        check(got, want, tokens, layers)
    top1 = results["top1"]["outputs"][-1].gate_summary
    assert top1.mean_weight == pytest.approx(top1.share, abs=1e-6)  # top-1: every weight is 1
    # attribution: each token's mean weight over layers per adapter, an independent read
    full = results["full"]
    attributed = {e: 0.0 for e in full["outputs"][-1].gate_summary.experts}
    for token in full["attribution"]:
        for name, w in token.adapters.items():
            attributed[name] += w / 7
    assert list(attributed.values()) == pytest.approx(
        full["outputs"][-1].gate_summary.mean_weight, abs=1e-3
    )
    assert engine.outputs.summaries.active == 0  # every row freed


def test_choices_and_rows_reused(tiny_engine_factory) -> None:
    """n > 1 siblings (one prefill, forked) each get their own summary; more requests than
    rows, aborted ones included, leave no row behind."""
    engine = tiny_engine_factory(max_num_seqs=2)
    prompt = random_prompts(1, 256, [9], seed=4)[0]
    route = LearnedRoute(composition="moe")
    reqs = [
        request("c.0", prompt, route, 6, return_gate_summary=True),
        request("c.1", prompt, route, 6, return_gate_summary=True, prefill_from="c.0"),
    ]
    reqs += [request(f"more{i}", prompt, route, 3, return_gate_summary=True) for i in range(3)]
    results = run_to_completion(engine, reqs)
    first, second = (results[r]["outputs"][-1].gate_summary for r in ("c.0", "c.1"))
    assert first is not None and second is not None
    assert first.tokens == second.tokens == 6
    assert results["c.0"]["tokens"] == results["c.1"]["tokens"]  # greedy: the same routing
    assert first == second
    for i in range(3):
        assert results[f"more{i}"]["outputs"][-1].gate_summary.tokens == 3
    engine.add_request(request("gone", prompt, route, 50, return_gate_summary=True))
    engine.step()
    engine.step()
    assert engine.outputs.summaries.active == 1
    engine.abort("gone")
    outs = [o for o in engine.step() if o.request_id == "gone"]
    assert outs[-1].finish_reason == "abort" and outs[-1].gate_summary is None
    assert engine.outputs.summaries.active == 0


def test_only_learned_routes_have_a_summary(tiny_engine_factory) -> None:
    engine = tiny_engine_factory()
    prompt = [1, 2, 3]
    for route in ["a", MixRoute(weights={"a": 0.5, "b": 0.5}), None]:
        with pytest.raises(InvalidRequestError, match="needs a learned composition"):
            engine.validate_request(request("x", prompt, route, 2, return_gate_summary=True))
    with pytest.raises(ValidationError, match="gate_summary_layers needs return_gate_summary"):
        request("x", prompt, LearnedRoute(composition="moe"), 2, gate_summary_layers=True)


def test_preempted_requests_count_each_token_once(tiny_engine_factory) -> None:
    """A preempted sequence's recompute prefill samples only its next token: the summary counts
    every generated token once, and routes them as the unpreempted run does."""
    prompts = random_prompts(5, 256, [9, 14, 5, 11, 7], seed=21)
    route = LearnedRoute(composition="moe")
    reqs = [
        request(f"r{i}", p, route, m, return_gate_summary=True, gate_summary_layers=True)
        for i, (p, m) in enumerate(zip(prompts, [14, 9, 16, 10, 12], strict=True))
    ]
    roomy = run_to_completion(tiny_engine_factory(kv_block_size=BS), reqs)
    tight = tiny_engine_factory(
        kv_block_size=BS, kv_cache_bytes=budget(tiny_engine_factory, 12), max_num_seqs=5
    )
    got = run_to_completion(tight, reqs)
    assert tight.stats().kv.preemptions > 0
    for req in reqs:
        rid = req.request_id
        assert got[rid]["tokens"] == roomy[rid]["tokens"]
        a, b = got[rid]["outputs"][-1].gate_summary, roomy[rid]["outputs"][-1].gate_summary
        assert a.tokens == b.tokens == req.sampling.max_tokens
        assert a.share == pytest.approx(b.share, abs=1e-5)
        assert a.mean_weight == pytest.approx(b.mean_weight, abs=1e-5)
        assert a.mean_entropy == pytest.approx(b.mean_entropy, abs=1e-5)
    assert tight.outputs.summaries.active == 0


def test_offline_llm_returns_summaries(tiny_llama, tiny_adapters, tiny_composition) -> None:
    llm = LLM(
        model=tiny_llama, adapters=tiny_adapters, compositions={"moe": tiny_composition},
        device="cpu", dtype="float32", enable_cuda_graph=False, max_model_len=128,
    )  # fmt: skip
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    routes = [LearnedRoute(composition="moe"), LearnedRoute(composition="moe", top_k=1)]
    out = llm.generate([[1, 2, 3], [4, 5]], params, routes=routes, return_gate_summary=True)
    assert [r.gate_summary.tokens for r in out] == [4, 4]
    assert out[1].gate_summary.share == pytest.approx(out[1].gate_summary.mean_weight)
    assert llm.generate([[1, 2]], params, routes="a")[0].gate_summary is None
    with pytest.raises(InvalidRequestError, match="needs a learned composition"):
        llm.generate([[1, 2]], params, routes="a", return_gate_summary=True)
