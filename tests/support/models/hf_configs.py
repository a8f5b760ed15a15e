"""Tiny `transformers` configs the tests build models from (nothing is fetched)."""

from __future__ import annotations


def tiny_llama(vocab_size: int, max_positions: int = 32) -> dict:
    """A two-layer Llama of width 16 with grouped-query attention (2 heads, 1 key/value head)
    and its embedding and head one tied weight."""
    return {
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": True,
    }
