"""Tiny random Llama configs (`LlamaConfig` keyword arguments) the tests build models from."""

from __future__ import annotations

# The smallest: the training tests' PEFT models.
TINY_LLAMA = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=32,
)
# 64 wide, 4 heads over 2 KV heads: the store's adapters and the logits-vs-transformers checks.
SMALL_LLAMA = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256,
)  # fmt: skip
