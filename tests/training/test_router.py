"""Router training on a tiny random model where the right adapter for each token is known."""

from __future__ import annotations

import torch

from molora_runtime.lora.peft_adapter import AdapterWeights
from molora_runtime.model.arch import arch_from_config
from molora_runtime.model.attention_meta import DenseAttention
from molora_runtime.model.decoder import CausalLM
from molora_runtime.training.experts import Gates, attach_experts, learned_context, static_context
from molora_runtime.training.router import TokenBatch, train_gates

VOCAB, HALF, T, K = 64, 32, 12, 2
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_model(seed: int = 0) -> CausalLM:
    arch = arch_from_config(
        {
            "model_type": "llama",
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "tie_word_embeddings": True,
        }
    )
    torch.manual_seed(seed)
    lm = CausalLM(arch)
    for name, p in lm.named_parameters():
        if "norm" in name:
            torch.nn.init.ones_(p)
        else:
            torch.nn.init.normal_(p, std=0.1 if "embed" not in name else 0.3)
    with torch.no_grad():  # the two halves of the vocabulary differ along one direction
        direction = torch.randn(arch.hidden_size)
        lm.embed_tokens.weight[:HALF] += 0.3 * direction
        lm.embed_tokens.weight[HALF:] -= 0.3 * direction
    lm.requires_grad_(False)
    return lm.eval()


def random_expert(lm: CausalLM, name: str, seed: int, rank: int = 4) -> AdapterWeights:
    gen = torch.Generator().manual_seed(seed)
    adapter = AdapterWeights(name=name, rank=rank)
    for module in MODULES:
        d_in, d_out = lm.arch.linear_shape(module)
        adapter.modules[module] = {
            layer: (
                torch.randn(rank, d_in, generator=gen) * 0.2,
                torch.randn(d_out, rank, generator=gen) * 0.2,
            )
            for layer in range(lm.arch.num_layers)
        }
    return adapter


def oracle_slots(ids: torch.Tensor) -> torch.Tensor:
    """Tokens in the lower half of the vocabulary belong to expert 1, the upper half to expert 2."""
    return torch.where(ids < HALF, 1, 2)


def forward(lm: CausalLM, ids: torch.Tensor, ctx) -> torch.Tensor:
    B, L = ids.shape
    meta = DenseAttention(batch=B, seq_len=L, positions=torch.arange(L).repeat(B))
    return lm.logits(lm.hidden_states(ids.reshape(-1), meta, None, ctx))


def synthetic_batches(lm: CausalLM, steps: int, batch: int, seed: int) -> list[TokenBatch]:
    """Sequences switching domain half-way; labels are what the per-token oracle route predicts."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        first = torch.randint(0, 2, (batch, 1), generator=gen)
        halves = torch.cat([first.expand(-1, T // 2), 1 - first.expand(-1, T - T // 2)], dim=1)
        ids = torch.randint(0, HALF, (batch, T), generator=gen) + HALF * halves
        with torch.no_grad():
            labels = forward(lm, ids, static_context(oracle_slots(ids).reshape(-1))).argmax(-1)
        out.append(
            TokenBatch(
                input_ids=ids,
                labels=labels.view(batch, T),
                valid=torch.ones(batch, T, dtype=torch.bool),
            )
        )
    return out


def test_learned_route_picks_the_known_adapter() -> None:
    torch.manual_seed(0)
    lm = tiny_model()
    attach_experts(lm, [random_expert(lm, "low", 1), random_expert(lm, "high", 2)])
    gates = Gates.init(lm.arch.num_layers, K, lm.arch.hidden_size, seed=0)
    batches = synthetic_batches(lm, steps=60, batch=16, seed=1)
    train_gates(lm, gates, batches, lr=0.1, balance_weight=0.01, entropy_weight=0.01)

    # Evaluate through the serving gate path: top-1 learned route, per-layer tables recorded.
    test = synthetic_batches(lm, steps=1, batch=32, seed=99)[0].input_ids
    ctx = learned_context(gates, test.numel(), top_k=1, record_layers=True)
    with torch.no_grad():
        forward(lm, test, ctx)
    want = oracle_slots(test).reshape(-1)
    picked = torch.stack([slots[:, 0] for slots, _ in ctx.layer_tables])  # [L, tokens]
    accuracy = (picked == want).float().mean().item()
    assert accuracy >= 0.95, f"learned route picked the right adapter for {accuracy:.1%} of tokens"


def test_gate_training_is_deterministic() -> None:
    results = []
    for _ in range(2):
        lm = tiny_model()
        attach_experts(lm, [random_expert(lm, "low", 1), random_expert(lm, "high", 2)])
        gates = Gates.init(lm.arch.num_layers, K, lm.arch.hidden_size, seed=3)
        train_gates(lm, gates, synthetic_batches(lm, steps=3, batch=4, seed=5), lr=0.01)
        results.append(gates.weight.detach().clone())
    assert torch.equal(results[0], results[1])


def test_resume_from_checkpoint_matches_straight_run(tmp_path) -> None:
    from molora_runtime.training.checkpoint import load_checkpoint, save_checkpoint

    def setup():
        lm = tiny_model()
        attach_experts(lm, [random_expert(lm, "low", 1), random_expert(lm, "high", 2)])
        gates = Gates.init(lm.arch.num_layers, K, lm.arch.hidden_size, seed=3)
        return lm, gates, synthetic_batches(lm, steps=6, batch=4, seed=5)

    lm, gates, batches = setup()
    train_gates(lm, gates, batches, lr=0.01)
    straight = gates.weight.detach().clone()

    lm, gates, batches = setup()
    opt = train_gates(lm, gates, batches, lr=0.01, stop=3)  # interrupted after step 3
    save_checkpoint(tmp_path, 3, gates.params(), opt, {"run": 1})
    lm, gates, batches = setup()
    opt = torch.optim.AdamW(gates.params().values(), lr=0.01, weight_decay=0.0)
    meta = load_checkpoint(tmp_path, gates.params(), opt, {"run": 1})
    assert meta is not None and meta["step"] == 3
    train_gates(lm, gates, batches, lr=0.01, start=3, optimizer=opt)
    assert torch.allclose(gates.weight, straight, atol=1e-6)


def test_route_supervision_teaches_the_known_adapter_in_few_steps() -> None:
    """With the domain of each token known, the supervision term routes it after a few steps."""
    lm = tiny_model()
    attach_experts(lm, [random_expert(lm, "low", 1), random_expert(lm, "high", 2)])
    gates = Gates.init(lm.arch.num_layers, K, lm.arch.hidden_size, seed=0)
    batches = synthetic_batches(lm, steps=15, batch=8, seed=1)
    for b in batches:
        b.route_labels = oracle_slots(b.input_ids) - 1
        b.route_labels[:, 0] = -100  # unlabelled positions are ignored
    train_gates(lm, gates, batches, lr=0.1, route_supervision=1.0)

    test = synthetic_batches(lm, steps=1, batch=32, seed=99)[0].input_ids
    ctx = learned_context(gates, test.numel(), top_k=1, record_layers=True)
    with torch.no_grad():
        forward(lm, test, ctx)
    picked = torch.stack([slots[:, 0] for slots, _ in ctx.layer_tables])
    accuracy = (picked == oracle_slots(test).reshape(-1)).float().mean().item()
    assert accuracy >= 0.95, f"supervised route picked the right adapter for {accuracy:.1%}"
