"""`molora compose add` on a tiny model and a real local store: only the new gate rows train,
the next version is published beside an untouched old one, it serves through the engine, and
bad inputs are refused with clear errors before anything is written."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoTokenizer

from adapter_store.errors import InvalidInputError, NotFoundError, VersionExistsError
from adapter_store.extend import next_version
from adapter_store.source import AdapterStoreSource
from adapter_store.versions import Registry, open_registry
from deployments.ops.cli import main as molora
from molora_runtime.engine.llm import LLM
from molora_runtime.engine.types import SamplingParams
from molora_runtime.lora.composition import load_composition
from molora_runtime.model.loader import load_model
from molora_runtime.model.tiny import make_tiny_model
from molora_runtime.routes import LearnedRoute
from molora_runtime.training.answer_check import (
    Probe,
    answer_predictions,
    check_examples,
    entered_rows,
    probe,
    unchanged_shares,
)
from molora_runtime.training.batching import IGNORE
from molora_runtime.training.compose_add import (
    ComposeAddConfig,
    GrowSettings,
    compose_add,
    train_new_rows,
)
from molora_runtime.training.experts import Gates, attach_experts
from molora_runtime.training.grow import (
    GrownGates,
    calibrate_new_bias,
    grow_examples,
    refit_new_rows,
    stay_out_loss,
    stay_out_mask,
)
from molora_runtime.training.router import TokenBatch, load_experts, routed_batches
from tests.molora_runtime.rt_util import make_composition, make_peft_adapter

OLD = ["arithmetic", "sorting"]
TINY_GROW = GrowSettings(steps=3, batch_size=2, lr=0.05, warmup=0)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny base (with a real tokenizer), four r=4 adapters on it, one r=8, one on another
    base, and a store holding them and composition `mol@v1` over arithmetic and sorting."""
    root = tmp_path_factory.mktemp("compose-add")
    base = make_tiny_model(root / "base", with_tokenizer=True, hidden_size=32)
    other = make_tiny_model(root / "other", with_tokenizer=True, hidden_size=32, seed=1)
    folders = {
        name: make_peft_adapter(base, root / name, r=4, alpha=8, seed=i, std=0.05)
        for i, name in enumerate([*OLD, "multiplication", "reversal"])
    }
    folders["counting"] = make_peft_adapter(base, root / "counting", r=8, alpha=8, seed=9)
    folders["foreign"] = make_peft_adapter(other, root / "foreign", r=4, alpha=8, seed=10)
    store = root / "store"
    registry = open_registry(str(store), create=True)
    for name, folder in folders.items():
        registry.publish_adapter(folder, name, "v1")
    comp = make_composition(base, root / "mol", [f"{n}@v1" for n in OLD], top_k=1, gate_scale=0.1)
    registry.publish_composition(comp, "mol", "v1")
    return {"base": base, "store": store, "folders": folders}


def fresh(world: dict) -> Registry:
    return open_registry(str(world["store"]))


def test_next_version_counts_up_and_refuses_other_schemes() -> None:
    assert next_version([]) == "v1"
    assert next_version(["v2", "v10", "v9"]) == "v11"
    with pytest.raises(InvalidInputError, match="--version"):
        next_version(["v2", "2024-01"])


def test_training_data_mixes_the_new_domain_with_a_replay_of_the_old() -> None:
    examples = grow_examples(OLD, "multiplication", 40, seed=0, new_fraction=0.5)
    with_new = [e for e in examples if "multiplication" in e.domains]
    assert len(examples) == 40 and len(with_new) == 20
    pairs = [tuple(e.domains) for e in with_new if e.kind == "mixed"]
    assert {p for p in pairs} == {
        (a, b) for o in OLD for a, b in [("multiplication", o), (o, "multiplication")]
    }
    replay = [e for e in examples if "multiplication" not in e.domains]
    assert {d for e in replay for d in e.domains} == set(OLD)


def test_stay_out_hinge_only_bites_where_the_new_row_enters_the_old_top_k() -> None:
    labels = torch.tensor([[0, 1, 2, IGNORE]])
    keep = stay_out_mask(labels, torch.ones_like(labels, dtype=torch.bool), 2).reshape(-1)
    low = torch.tensor([[3.0, 2.0, 0.0]] * 4)  # new logit a margin below the 2nd old one
    assert stay_out_loss([low], keep, new_index=2, top_k=2, margin=1.0).item() == 0.0
    high = torch.tensor([[3.0, 2.0, 2.5]] * 4)
    loss = stay_out_loss([high], keep, new_index=2, top_k=2, margin=1.0)
    assert loss.item() == pytest.approx(1.5)  # tokens of the new expert and unlabelled ones skip


def test_stay_out_covers_every_token_of_a_replay_prompt_but_no_padding() -> None:
    """Template tokens (unlabelled) stay out in prompts without the new domain; in a prompt
    with it they are free, and the new domain's own tokens never stay out."""
    labels = torch.tensor([[IGNORE, 0, 1, IGNORE], [IGNORE, 2, 0, IGNORE]])
    valid = torch.tensor([[True, True, True, False], [True, True, True, True]])
    keep = stay_out_mask(labels, valid, new_index=2)
    assert keep.tolist() == [[True, True, True, False], [False, False, True, False]]


def test_only_the_new_rows_train(world: dict) -> None:
    """Old rows, base weights and expert slot buffers are bit-identical after training."""
    base = world["base"]
    lm = load_model(base, dtype=torch.float32)
    refs = {n: str(world["folders"][n]) for n in [*OLD, "multiplication"]}
    attach_experts(lm, load_experts(lm, refs))
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    buffers = {
        (lin.name, lin.layer): (lin.lora.A.clone(), lin.lora.B.clone())
        for lin in lm.lora_linears()
        if lin.lora is not None
    }
    assert buffers, "the experts adapt some projection"
    L, d = lm.arch.num_layers, lm.arch.hidden_size
    weight, bias = torch.randn(L, 2, d), torch.randn(L, 2)
    grown, cpu_s = train_new_rows(
        lm, AutoTokenizer.from_pretrained(base), weight, bias, OLD, "multiplication", TINY_GROW, 1
    )
    assert cpu_s > 0
    assert torch.equal(grown.weight[:, :2], weight) and torch.equal(grown.bias[:, :2], bias)
    init = weight.mean(1)
    assert not torch.equal(grown.weight[:, 2].detach(), init), "the new row did not move"
    after = lm.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    for lin in lm.lora_linears():
        if lin.lora is not None:
            a, b = buffers[(lin.name, lin.layer)]
            assert torch.equal(lin.lora.A, a) and torch.equal(lin.lora.B, b)
    assert set(grown.params()) == {"gate.new_weight", "gate.new_bias"}


def _grown_world(world: dict, prompts: int, seed: int) -> tuple:
    """The tiny model with the old experts and the new one attached, random old gate rows
    (`weight`, `bias`) grown by one, and routed batches of `prompts` examples per domain."""
    base = world["base"]
    lm = load_model(base, dtype=torch.float32)
    refs = {n: str(world["folders"][n]) for n in [*OLD, "multiplication"]}
    attach_experts(lm, load_experts(lm, refs))
    tokenizer = AutoTokenizer.from_pretrained(base)
    L, d = lm.arch.num_layers, lm.arch.hidden_size
    weight, bias = torch.randn(L, 2, d), torch.randn(L, 2)
    grown = GrownGates.extend(weight, bias)
    examples = grow_examples(OLD, "multiplication", prompts, seed=seed)
    batches = routed_batches(tokenizer, examples, [*OLD, "multiplication"], 4, torch.device("cpu"))
    return lm, weight, bias, grown, batches


def test_calibration_pushes_an_intruding_row_out_of_old_tokens_top_k(world: dict) -> None:
    """A new row whose bias wins every token is lowered until the old domains' held-out tokens
    route as before (all but the quantile), while the old rows stay bit-identical."""
    lm, weight, bias, grown, batches = _grown_world(world, prompts=8, seed=3)
    with torch.no_grad():
        grown.new_bias.fill_(100.0)
    shares = calibrate_new_bias(lm, grown, batches, top_k=1, quantile=1.0, margin=0.1)
    assert shares["old_tokens_new_in_top_k_before"] == 1.0
    assert shares["old_tokens_new_in_top_k_after"] == 0.0
    assert shares["mean_bias_shift"] > 0
    assert torch.equal(grown.weight[:, :2], weight) and torch.equal(grown.bias[:, :2], bias)
    again = calibrate_new_bias(lm, grown, batches, top_k=1, quantile=1.0, margin=0.1)
    assert again["mean_bias_shift"] == 0.0  # already out: nothing more to lower


def test_unchanged_shares_count_old_prompts_whose_answer_predictions_all_hold() -> None:
    """A prompt counts for every old domain its answer serves; prompts with the new domain and
    predictions outside the answer are ignored."""
    ids = torch.zeros(4, 5, dtype=torch.long)
    labels = torch.full((4, 5), IGNORE)
    labels[:, 2:] = 7
    route = torch.tensor(
        [[-100, 0, 0, 0, 0], [-100, 1, 1, 1, 1], [-100, 0, 0, 1, 1], [-100, 2, 2, 2, 2]]
    )
    batch = TokenBatch(ids, labels, torch.ones(4, 5, dtype=torch.bool), route)
    old = torch.zeros(4, 5, dtype=torch.long)
    new = old.clone()
    new[0, 1] = 5  # a prompt position: not an answer prediction
    new[1, 3] = 5  # domain 1's own prompt changes
    new[3, 4] = 5  # the new domain's (2): not counted
    shares = unchanged_shares([batch], [old], [new], new_index=2)
    assert shares == {0: 1.0, 1: 0.5}


def test_entered_rows_flag_prompts_where_the_lowered_row_reaches_some_valid_top_k() -> None:
    """A prompt reruns only if some valid token of an adapted layer has the new logit at or
    above the old k-th one once the bias drop is taken off."""
    ids = torch.zeros(3, 2, dtype=torch.long)
    valid = torch.tensor([[True, True], [True, False], [True, True]])
    batch = TokenBatch(ids, torch.full((3, 2), IGNORE), valid, None)
    gap = torch.tensor(
        [
            [5.0, 5.0, 5.0, 5.0, 5.0, 5.0],  # layer 0: not adapted, never counts
            [-1.0, 0.5, -1.0, 2.0, -3.0, -3.0],  # row 0 token 1: 0.5; row 1 token 1: padding
        ]
    )
    p = Probe(batch, torch.zeros(3, 2, dtype=torch.long), gap)
    assert entered_rows(p, torch.tensor([0.0, 0.0]), [1]).tolist() == [True, False, False]
    assert entered_rows(p, torch.tensor([0.0, 0.5]), [1]).tolist() == [True, False, False]
    assert entered_rows(p, torch.tensor([0.0, 0.6]), [1]).tolist() == [False, False, False]
    assert entered_rows(p, torch.tensor([0.0, 0.0]), [0, 1]).tolist() == [True, True, True]


def test_check_prompts_are_one_task_prompts_of_each_old_domain_apart_from_training() -> None:
    examples = check_examples(OLD, 5, seed=0)
    assert [e.domains for e in examples] == [["arithmetic"]] * 5 + [["sorting"]] * 5
    train = {e.tasks[0].question for e in grow_examples(OLD, "multiplication", 40, seed=0)}
    assert not train & {e.tasks[0].question for e in examples}
    assert check_examples(OLD, 0, seed=0) == []


def test_a_probe_records_the_old_answers_and_rows_it_leaves_out_route_as_before(
    world: dict,
) -> None:
    """Prompts where the new row, its bias moved by some drop, enters no top-k answer under the
    grown gates exactly as the probe recorded under the old ones."""
    lm, weight, bias, grown, batches = _grown_world(world, prompts=8, seed=11)
    layers = sorted({lin.layer for lin in lm.lora_linears() if lin.lora is not None})
    old = Gates(weight, bias)  # type: ignore[arg-type]
    seen = set()
    for batch in batches:
        p = probe(lm, grown, batch, top_k=1)
        assert torch.equal(p.reference, answer_predictions(lm, old, batch, 1))
        B, T = batch.input_ids.shape
        gaps = p.gap[layers].reshape(len(layers), B, T).masked_fill(~batch.valid, -torch.inf)
        drop = torch.full((weight.shape[0],), float(gaps.amax((0, 2)).median()))
        rows = entered_rows(p, drop, layers)
        seen |= set(rows.tolist())
        new_bias = grown.new_bias.detach() - drop[:, None]
        gates = Gates(grown.weight.detach(), torch.cat([bias, new_bias], 1))  # type: ignore[arg-type]
        got = answer_predictions(lm, gates, batch, 1)
        assert torch.equal(got[~rows], p.reference[~rows])
    assert seen == {True, False}, "the check needs both kinds of prompt"


def test_relaxed_calibration_keeps_old_answers_and_never_lowers_more_than_the_bound(
    world: dict,
) -> None:
    """The bias drop given back leaves the old composition's answer predictions on held-out
    old prompts as the `keep` share demands; `keep` above 1 keeps the whole drop, 0 none."""
    lm, _, _, grown, batches = _grown_world(world, prompts=16, seed=7)
    with torch.no_grad():
        grown.new_bias.fill_(100.0)
    whole = calibrate_new_bias(lm, copy.deepcopy(grown), batches, 1, 1.0, 0.1, keep_answers=None)
    never = calibrate_new_bias(lm, copy.deepcopy(grown), batches, 1, 1.0, 0.1, keep_answers=1.01)
    assert never == {**whole, "shift_scale": 1.0}
    free = calibrate_new_bias(lm, copy.deepcopy(grown), batches, 1, 1.0, 0.1, keep_answers=0.0)
    assert free["shift_scale"] == 0.0 and free["mean_bias_shift"] == 0.0
    shares = calibrate_new_bias(lm, grown, batches, 1, 1.0, 0.1, keep_answers=0.98)
    assert shares["mean_bias_shift"] <= whole["mean_bias_shift"]
    old = Gates(grown.old_weight, grown.old_bias)  # type: ignore[arg-type]
    grown_gates = Gates(grown.weight.detach(), grown.bias.detach())  # type: ignore[arg-type]
    reference = [answer_predictions(lm, old, b, 1) for b in batches]
    got = [answer_predictions(lm, grown_gates, b, 1) for b in batches]
    assert min(unchanged_shares(batches, reference, got, grown.new_index).values()) >= 0.98


def test_refit_separates_the_new_domain_from_the_old_ones(world: dict) -> None:
    """From the mean-of-rows start (never in the top-1), the logistic refit makes the new row
    enter the top-1 on more new-domain tokens than old ones, touching no old row."""
    lm, weight, bias, grown, batches = _grown_world(world, prompts=16, seed=5)
    start = calibrate_new_bias(lm, copy.deepcopy(grown), batches, top_k=1, quantile=1.0, margin=0)
    assert start["new_tokens_new_in_top_k_before"] == 0.0
    refit_new_rows(lm, grown, batches, top_k=1, margin=1.0, steps=200)
    fitted = calibrate_new_bias(lm, copy.deepcopy(grown), batches, top_k=1, quantile=1.0, margin=0)
    assert fitted["new_tokens_new_in_top_k_before"] > fitted["old_tokens_new_in_top_k_before"]
    assert torch.equal(grown.weight[:, :2], weight) and torch.equal(grown.bias[:, :2], bias)


def test_publishes_next_version_and_serves_it(world: dict) -> None:
    registry = fresh(world)
    v1 = registry.manifest("composition", "mol", "v1")
    v1_gates = load_composition(
        "mol", AdapterStoreSource(registry=registry).composition_path("mol@v1")
    )
    cfg = ComposeAddConfig(
        composition="mol", adapter="multiplication", device="cpu", grow=TINY_GROW
    )
    manifest, _ = compose_add(registry, cfg)
    assert manifest.ref == "mol@v2"
    assert manifest.adapters == ["arithmetic@v1", "sorting@v1", "multiplication@v1"]

    registry = fresh(world)
    assert registry.manifest("composition", "mol", "v1") == v1  # version N unchanged
    assert registry.verify(v1) == []
    assert registry.latest("composition", "mol").version == "v2"
    source = AdapterStoreSource(store_url=str(world["store"]))
    v2 = load_composition("mol", source.composition_path("mol@v2"))
    assert v2.gate_weight.shape[1] == 3
    assert torch.equal(v2.gate_weight[:, :2], v1_gates.gate_weight)
    assert v2.gate_bias is not None and v1_gates.gate_bias is not None
    assert torch.equal(v2.gate_bias[:, :2], v1_gates.gate_bias)

    llm = LLM(
        model=world["base"],
        source=source,
        dtype="float32",
        device="cpu",
        enable_cuda_graph=False,
        max_model_len=256,
        max_num_seqs=4,
        hot_set={"num_slots": 4},
    )
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = llm.generate(
        ["1. Multiply: 3 * 4"], sp, routes=LearnedRoute(composition="mol", top_k=3),
        return_attribution=True,
    )  # fmt: skip
    assert len(out[0].token_ids) == 4
    served = {name.split("@")[0] for a in out[0].attribution or [] for name in a.adapters}
    assert "multiplication" in served, served


@pytest.mark.parametrize(
    ("composition", "adapter", "extra", "error", "match"),
    [
        ("nope", "multiplication", {}, NotFoundError, "nope"),
        ("mol@v1", "nope", {}, NotFoundError, "nope"),
        ("mol@v1", "sorting", {}, InvalidInputError, "already expert 2"),
        ("mol@v1", "counting", {}, InvalidInputError, "rank 8"),
        ("mol@v1", "foreign", {}, InvalidInputError, "base model"),
        ("mol@v1", "reversal", {"data": "nope"}, InvalidInputError, "no training domain"),
        ("mol@v1", "reversal", {"data": "sorting"}, InvalidInputError, "domain of its own"),
        ("mol@v1", "reversal", {"version": "v1"}, VersionExistsError, "immutable"),
        ("mol@v1", "reversal", {"top_k": 9}, InvalidInputError, "top_k=9"),
    ],
)
def test_bad_inputs_are_refused_before_anything_is_written(
    world: dict, composition: str, adapter: str, extra: dict, error: type, match: str
) -> None:
    registry = fresh(world)
    before = {k for k in registry.backend.list_keys("")}
    cfg = ComposeAddConfig(composition=composition, adapter=adapter, device="cpu", **extra)
    with pytest.raises(error, match=match):
        compose_add(registry, cfg)
    assert {k for k in fresh(world).backend.list_keys("")} == before


def test_cli_exit_codes(world: dict, capsys: pytest.CaptureFixture[str]) -> None:
    store = str(world["store"])
    args = ["compose", "add", "--store", store, "--composition", "mol@v1"]
    assert molora([*args, "--adapter", "ghost"]) == 4
    assert "ghost" in capsys.readouterr().err
    assert molora([*args, "--adapter", "counting", "--json"]) == 3
    assert '"exit_code": 3' in capsys.readouterr().out
    assert molora([*args, "--adapter", "reversal", "--steps", "0"]) == 3
    assert molora([*args, "--adapter", "reversal", "--version", "v1"]) == 5
