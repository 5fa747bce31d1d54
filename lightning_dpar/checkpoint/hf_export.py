"""Export back to Hugging Face: `consolidate CKPT OUT --format hf` writes a directory `from_pretrained` loads.

At save time `hf_model_record` notes, in the checkpoint's metadata (`meta.pt`), which submodule of the
LightningModule is a `transformers.PreTrainedModel`, its `config.json` and generation config (JSON strings). The
export then:

1. takes that submodule's tensors from the checkpoint with its prefix (`model.`, `net.`) stripped;
2. builds the model class from the config on the meta device (no memory) and compares keys and shapes: a key the
   model expects but the checkpoint lacks, a key the model does not know, or a different shape is an error, never
   a `from_pretrained` that silently starts from random weights;
3. drops the second name of each tied parameter (`lm_head.weight` under `tie_word_embeddings`), splits each fused
   expert parameter of a mixture-of-experts model into one tensor per expert and projection
   (`mlp.experts.gate_up_proj` [E, 2I, H] into `mlp.experts.E.gate_proj.weight` and `...up_proj.weight`;
   `lightning_dpar.experts.keys`) and renames what the class stores under another name (GPT-NeoX's `lm_head` as
   `embed_out`, Mixtral's `mlp.` as `block_sparse_moe.`; `lightning_dpar.hf_weights.hf_keys`), as `save_pretrained`
   does;
4. streams the tensors into safetensors files one at a time (see `consolidate.write_safetensors`), then writes
   `config.json` and `generation_config.json`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_dpar.experts.keys import ExpertPart, split_fused
from lightning_dpar.helpers import transformers_models
from lightning_dpar.hf_weights import hf_keys
from lightning_dpar.hf_weights.key_matching import (
    map_keys,
    tied_groups,
)  # the key matching of loading pretrained weights

#: Key of the record in a checkpoint's metadata (`meta.pt`, or the dict of a full-format file).
__all__ = [
    "HF_MODEL_KEY",
    "ExportError",
    "hf_model_record",
    "hf_tensor_names",
    "require_record",
    "strip_prefix",
    "write_configs",
]

HF_MODEL_KEY = "hf_model"


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked (no Hugging Face config, keys that do not fit the model)."""


def hf_model_record(module: nn.Module) -> dict[str, Any]:
    """`{HF_MODEL_KEY: {...}}` for a LightningModule that holds exactly one outermost `PreTrainedModel`, else `{}`.

    Cheap (configs only), and never imports `transformers` itself: a model of that library means it is imported.
    """
    outermost = transformers_models(module)
    if len(outermost) != 1 or outermost[0][0] == "":
        return {}
    name, model = outermost[0]
    # FSDP2 and `replicate` swap in a subclass of their own (`FSDPLlamaForCausalLM`): name the library's class.
    library_class = next(c for c in type(model).__mro__ if c.__module__.startswith("transformers."))
    config = json.loads(model.config.to_json_string())
    config["architectures"] = [library_class.__name__]  # as `save_pretrained` records it
    generation = getattr(model, "generation_config", None)
    return {
        HF_MODEL_KEY: {
            "prefix": f"{name}.",
            "class": library_class.__name__,
            "config": json.dumps(config, indent=2, sort_keys=True) + "\n",
            "generation_config": generation.to_json_string() if generation is not None else None,
        }
    }


def strip_prefix(names: list[str], prefix: str) -> dict[str, str]:
    """`{exported name: checkpoint name}` for the names under `prefix`; all must be under it (else an error)."""
    outside = [n for n in names if not n.startswith(prefix)]
    if outside:
        raise ExportError(
            f"--strip-prefix {prefix!r}: {len(outside)} tensors are not under it, e.g. {outside[:5]}. Tensor names look"
            f" like {names[:3]}; give the prefix they share (with its trailing dot), or none."
        )
    return {n[len(prefix) :]: n for n in names}


def hf_tensor_names(
    record: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]
) -> tuple[dict[str, str | ExpertPart], list[str]]:
    """Checkpoint tensors -> the Hugging Face model's names: `({exported name: checkpoint name}, left out)`; a fused
    expert parameter is exported as its per-expert tensors, each an `ExpertPart` of the checkpoint tensor.

    `shapes` maps the checkpoint's tensor names (relative to the LightningModule) to their shapes; tensors outside
    the model's prefix (a LightningModule's own heads or buffers) are left out and returned as such. Raises
    `ExportError` if the result would not load into the model class exactly.
    """
    prefix = record["prefix"]
    inside = {n[len(prefix) :]: n for n in shapes if n.startswith(prefix)}
    left_out = [n for n in shapes if not n.startswith(prefix)]
    expected, tied = _expected_tensors(record)
    mapping = map_keys(expected, {k: tuple(shapes[v]) for k, v in inside.items()}, "", tied)
    problems = mapping.problems(strict=True)
    if problems:
        raise ExportError(
            f"The checkpoint's {record['class']} (the LightningModule's {prefix!r}) does not fit that class built from"
            f" its own config: {'; '.join(problems)}. Export with --format safetensors instead."
        )
    duplicates = {name for group in tied for name in group[1:]}
    model_type = json.loads(record["config"]).get("model_type")
    merges = hf_keys.expert_merges(record["class"], model_type)
    exported: dict[str, str | ExpertPart] = {}
    for name in (k for k in inside if k not in duplicates):
        exported.update(split_fused(name, shapes[inside[name]], merges, inside[name]) or {name: inside[name]})
    # As `save_pretrained` names them (GPT-NeoX's `lm_head` is stored as `embed_out`;
    # `lightning_dpar.hf_weights.hf_keys`).
    saved = hf_keys.saved_names(record["class"], model_type, exported)
    return {saved[k]: source for k, source in exported.items()}, left_out


def _expected_tensors(record: Mapping[str, Any]) -> tuple[dict[str, tuple[int, ...]], list[list[str]]]:
    """Keys and shapes of the recorded class built from the recorded config on the meta device, and its ties."""
    try:
        import transformers
    except ImportError as error:
        raise ExportError("--format hf needs `transformers`: pip install 'lightning-dpar[hf]'.") from error
    config_dict = json.loads(record["config"])
    config = transformers.CONFIG_MAPPING[config_dict["model_type"]].from_dict(config_dict)
    model_class = getattr(transformers, record["class"], None)
    if model_class is None:
        raise ExportError(
            f"The checkpoint holds a {record['class']}, which this transformers {transformers.__version__} lacks."
        )
    with torch.device("meta"):
        model = model_class(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}, tied_groups(model)


def write_configs(record: Mapping[str, Any], out: Path) -> list[Path]:
    """`config.json` and (if recorded) `generation_config.json`, as `save_pretrained` names them."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "config.json"]
    written[0].write_text(record["config"])
    if record.get("generation_config"):
        written.append(out / "generation_config.json")
        written[1].write_text(record["generation_config"])
    return written


def require_record(metadata: Mapping[str, Any], url: str) -> Mapping[str, Any]:
    record = metadata.get(HF_MODEL_KEY)
    if record is None:
        raise ExportError(
            f"{url!r} has no Hugging Face config: it was saved from a LightningModule that holds no single"
            " `transformers.PreTrainedModel` (or by an older lightning_dpar). Use `--format safetensors"
            " --strip-prefix PREFIX` and supply config.json yourself."
        )
    return record
