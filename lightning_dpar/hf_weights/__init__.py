"""Hugging Face and peft weights in: `pretrained=` reads a `save_pretrained` directory into the parallel model's
shards, each rank reading only its own slices.

- `pretrained`: `PretrainedWeights` and the load itself;
- `key_matching`: matching the directory's keys to the model's (prefixes, tied weights), shared with the exports in
  `lightning_dpar.checkpoint` (`hf_export`, `peft_export`), which write weights back out;
- `hf_keys`: the transformers key conventions (fused and per-expert layouts, renamed keys);
- `peft_keys`: peft's key conventions (adapter names, `base_layer`), without importing peft.
"""

__all__: list[str] = []
