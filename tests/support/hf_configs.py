"""The transformers decoder configs the tests and benchmarks build, written once: the tiny decoder's sizes (2
layers of hidden 32, 4 query heads over 2 key/value heads, so head_dim 8; a vocabulary of 64) unless a caller gives
others. What a caller does not give is left to the config class's own default, so each caller's config is exactly
the one it wrote out before: a test that depends on head_dim, the maximum positions or tied embeddings says so."""

from __future__ import annotations

from typing import Any


def decoder_settings(
    *,
    vocab_size: int = 64,
    hidden_size: int = 32,
    intermediate_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int | None = 2,
    head_dim: int | None = None,
    max_position_embeddings: int | None = None,
    tie_word_embeddings: bool | None = None,
    **more: Any,
) -> dict[str, Any]:
    """The keyword arguments of a decoder config. `None` leaves a setting out (the class's default holds;
    `num_key_value_heads=None` for a family without grouped-query attention, such as GPT-NeoX); `more` (special
    token ids, say) is passed as given."""
    settings = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
    }
    return {**{k: v for k, v in settings.items() if v is not None}, **more}


def decoder_config(config_class: str = "LlamaConfig", **settings: Any):
    """`transformers.<config_class>(**decoder_settings(**settings))`."""
    import transformers

    return getattr(transformers, config_class)(**decoder_settings(**settings))


def llama_plan_splits_the_embedding() -> bool:
    """Whether this transformers' own Llama tensor-parallel plan splits the embedding (`embedding_rowwise`): 5.24's
    does, 5.17's (the floor, the GPU images' version) leaves it replicated. `tp_plan="auto"` applies the model's own
    plan either way, so a test of that plan asks which it is."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**decoder_settings(num_hidden_layers=1)))
    return "model.embed_tokens" in (model._tp_plan or {})
