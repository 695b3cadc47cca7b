"""The smallest Llama config the training tests build with transformers (random weights)."""

from __future__ import annotations

TINY_LLAMA = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=32,
)
