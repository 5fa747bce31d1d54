"""Tiny transformers mixture-of-experts models (Qwen3-MoE, Mixtral: hidden 32, 4 experts, top-2, 2 layers,
intermediate 16, vocab 128, fp32) and their weights on disk in the layouts a `pretrained=` directory comes in:

- `save_pretrained`: what transformers itself writes (one tensor per expert: `mlp.experts.3.gate_proj.weight`, and
  for Mixtral its original names, `block_sparse_moe.experts.3.w1.weight`);
- `per_expert`: the same layout written here from the state dict with safetensors, over three files with an index,
  the experts of one layer spread across files;
- `fused`: the model's own fused tensors (`mlp.experts.gate_up_proj` [E, 2I, H]), as its state dict holds them.

Written from one model per kind (`source`), whose parameters every loaded one must equal exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.support.hf_configs import decoder_config

KINDS = ("qwen3_moe", "mixtral")
LAYOUTS = ("save_pretrained", "per_expert", "fused")
EXPERTS, INTERMEDIATE, HIDDEN = 4, 16, 32


def config(kind: str, **overrides):
    """The tiny config of `kind` (the tests' tiny decoder with 4 experts of width 16 per layer, top-2); `overrides`
    change any setting."""
    if kind == "qwen3_moe":
        experts = dict(num_experts=EXPERTS, moe_intermediate_size=INTERMEDIATE, intermediate_size=64)
    else:
        experts = dict(num_local_experts=EXPERTS, intermediate_size=INTERMEDIATE)
    settings = dict(
        hidden_size=HIDDEN, head_dim=8, vocab_size=128, num_experts_per_tok=2, max_position_embeddings=64, **experts
    )
    config_class = "Qwen3MoeConfig" if kind == "qwen3_moe" else "MixtralConfig"
    return decoder_config(config_class, **{**settings, **overrides})


def deepseek_v3_config(**overrides):
    """A tiny DeepSeek-V3 (multi-head latent attention; 3 layers, the first dense, the others with 4 routed experts of
    width 16, top-2, and a shared expert): its router holds a `[num_experts, hidden]` weight and a `num_experts` of
    its own, and its experts start after the dense layers, as in the 671B model."""
    from transformers import DeepseekV3Config

    settings = dict(
        vocab_size=128,
        hidden_size=HIDDEN,
        intermediate_size=64,
        moe_intermediate_size=INTERMEDIATE,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        max_position_embeddings=64,
    )
    return DeepseekV3Config(**{**settings, **overrides})


def source(kind: str, seed: int = 0):
    """The model whose weights every directory of `kind` holds (fp32)."""
    import transformers

    torch.manual_seed(seed)
    cls = transformers.Qwen3MoeForCausalLM if kind == "qwen3_moe" else transformers.MixtralForCausalLM
    return cls(config(kind))


def per_expert_tensors(kind: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict as published checkpoints store it: each fused expert tensor split per expert by hand (gate
    rows first, then up), Mixtral under its original names (`block_sparse_moe.`, `w1`/`w3`/`w2`)."""
    names = ("gate_proj", "up_proj", "down_proj") if kind == "qwen3_moe" else ("w1", "w3", "w2")
    block = "mlp" if kind == "qwen3_moe" else "block_sparse_moe"
    out = {}
    for key, tensor in state.items():
        layer, _, leaf = key.rpartition(".mlp.")
        if leaf == "experts.gate_up_proj":
            for e in range(tensor.shape[0]):
                out[f"{layer}.{block}.experts.{e}.{names[0]}.weight"] = tensor[e, :INTERMEDIATE].clone()
                out[f"{layer}.{block}.experts.{e}.{names[1]}.weight"] = tensor[e, INTERMEDIATE:].clone()
        elif leaf == "experts.down_proj":
            for e in range(tensor.shape[0]):
                out[f"{layer}.{block}.experts.{e}.{names[2]}.weight"] = tensor[e].clone()
        elif layer:
            out[f"{layer}.{block}.{leaf}"] = tensor.clone()
        else:
            out[key] = tensor.clone()
    return out


def write_files(tensors: dict[str, torch.Tensor], directory: Path, files: int, config_json: str) -> None:
    """`tensors` in `files` safetensors files (round-robin, so one layer's experts spread over all of them) with
    `model.safetensors.index.json`, and `config.json`."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-{files:05d}.safetensors" for i in range(files)]
    weight_map = {key: names[i % files] for i, key in enumerate(sorted(tensors))}
    for name in names:
        part = {k: v.contiguous() for k, v in tensors.items() if weight_map[k] == name}
        save_file(part, directory / name, metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in tensors.values())}}
    (directory / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": weight_map}))
    (directory / "config.json").write_text(config_json)


def write_layouts(root: Path) -> None:
    """`root/<kind>_<layout>` for every kind and layout."""
    for kind in KINDS:
        model = source(kind)
        model.save_pretrained(root / f"{kind}_save_pretrained")
        state = {k: v.detach() for k, v in model.state_dict().items()}
        config_json = model.config.to_json_string()
        write_files(per_expert_tensors(kind, state), root / f"{kind}_per_expert", 3, config_json)
        write_files(state, root / f"{kind}_fused", 2, config_json)
