"""Adapters out of a checkpoint: `consolidate CKPT OUT --format peft` and `--format hf --merge-adapters`.

At save time `peft_model_record` notes, in the checkpoint's metadata, where the LightningModule holds its
`peft.PeftModel` and each adapter's config exactly as `PeftConfig.save_pretrained` writes `adapter_config.json`
(so the export carries the trained model's real config: rank, alpha, targets, dropout, bias, ...).

`--format peft` writes `adapter_model.safetensors` and `adapter_config.json`, which `PeftModel.from_pretrained(base,
OUT)` loads. Which tensors and under which names is peft's own rule (`get_peft_model_state_dict`: the adapter
name dropped, `lora_A.default.weight` -> `lora_A.weight`), applied to the recorded base class and adapter config
built on the meta device (no memory); only those tensors are read from the checkpoint.

`--format hf --merge-adapters` writes the merged model, as `peft_model.merge_and_unload().save_pretrained(OUT)`
does, for `AutoModelForCausalLM.from_pretrained`. The base comes from the checkpoint, or, for an adapter-only one,
from `--base DIR` (the base's `save_pretrained` directory, checked against the fingerprint the checkpoint recorded),
with what the checkpoint holds of the base model on top (a layer norm trained besides the adapters).
The merge runs in peft, on the whole model in this process's memory.

Both work from a full checkpoint and from an adapter-only one (`checkpoint.adapter_only`).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_dpar.checkpoint.adapter_only import ADAPTER_ONLY_KEY, base_fingerprint
from lightning_dpar.checkpoint.contents import DPAR_KEY
from lightning_dpar.checkpoint.hf_export import ExportError, require_record
from lightning_dpar.hf_weights import peft_keys
from lightning_dpar.hf_weights.pretrained import tied_groups

__all__ = [
    "PEFT_MODEL_KEY",
    "export_merged",
    "export_peft",
    "peft_model_record",
    "peft_tensor_names",
]

#: Key of the record in a checkpoint's metadata (`meta.pt`, or the dict of a full-format file).
PEFT_MODEL_KEY = "peft_model"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def peft_model_record(module: nn.Module) -> dict[str, Any]:
    """`{PEFT_MODEL_KEY: {"prefix": ..., "adapters": {name: adapter_config.json text}}}` for a LightningModule that
    holds exactly one outermost `PeftModel` (below the LightningModule itself), else `{}`. Cheap (configs only)."""
    held = peft_keys.peft_models(module)
    if len(held) != 1 or held[0][0] == "":
        return {}
    name, model = held[0]
    adapters = {}
    with tempfile.TemporaryDirectory() as directory:
        for adapter, config in model.peft_config.items():
            config.save_pretrained(directory)  # the file exactly as peft writes it
            adapters[adapter] = (Path(directory) / ADAPTER_CONFIG).read_text()
    return {PEFT_MODEL_KEY: {"prefix": f"{name}.", "adapters": adapters}}


def require_peft_record(metadata: Mapping[str, Any], url: str) -> Mapping[str, Any]:
    record = metadata.get(PEFT_MODEL_KEY)
    if record is None:
        raise ExportError(
            f"{url!r} holds no peft adapter: it was saved from a LightningModule without a `peft.PeftModel` (or by an"
            " older lightning_dpar). Use --format hf or --format safetensors."
        )
    return record


def _peft():
    try:
        import peft
    except ImportError as error:
        raise ExportError("--format peft and --merge-adapters need `peft`: pip install peft.") from error
    return peft


def _adapter(record: Mapping[str, Any], adapter: str | None) -> tuple[str, Any]:
    """The adapter's name and `PeftConfig` (the only adapter when `adapter` is None)."""
    adapters = record["adapters"]
    if adapter is None:
        if len(adapters) != 1:
            raise ExportError(
                f"The checkpoint's model has several adapters {sorted(adapters)}: pick one with --adapter."
            )
        adapter = next(iter(adapters))
    if adapter not in adapters:
        raise ExportError(f"--adapter {adapter!r}: the checkpoint's model has the adapters {sorted(adapters)}.")
    return adapter, _peft().PeftConfig.from_peft_type(**json.loads(adapters[adapter]))


def _meta_peft_model(hf_record: Mapping[str, Any], config: Any, adapter: str) -> nn.Module:
    """The recorded base class with the adapter, built on the meta device (names and shapes only)."""
    model_class, model_config = _model_class_and_config(hf_record)
    with torch.device("meta"):
        return _with_adapter(model_class(model_config), config, adapter)


def _with_adapter(model: nn.Module, config: Any, adapter: str) -> nn.Module:
    """`get_peft_model`, the model named as the adapter's config names its base (else peft replaces that name in
    the config with the model's, and warns)."""
    model.name_or_path = config.base_model_name_or_path
    return _peft().get_peft_model(model, config, adapter_name=adapter)


def peft_tensor_names(model: nn.Module, adapter: str) -> dict[str, str]:
    """`{name in adapter_model.safetensors: name in the PeftModel's state dict}`, by peft's own rule."""
    state = model.state_dict(keep_vars=True)
    key_of = {id(value): key for key, value in state.items()}
    exported = _peft().get_peft_model_state_dict(model, state_dict=state, adapter_name=adapter)
    names = {}
    for name, value in exported.items():
        if id(value) not in key_of:
            raise ExportError(
                f"peft computes the exported tensor {name!r} instead of copying it from the model (an adapter type"
                " this export does not support); export the model with --format safetensors."
            )
        names[name] = key_of[id(value)]
    return names


def _records(metadata: Mapping[str, Any], url: str) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    return require_peft_record(metadata, url), require_record(metadata, url)


def _adapter_tensors(checkpoint: Any, adapter: str | None) -> tuple[dict[str, torch.Tensor], str, Any, nn.Module]:
    """The adapter's tensors, read from `checkpoint` (an `OfflineCheckpoint`) under peft's file names."""
    metadata, url = checkpoint.info.metadata, checkpoint.info.location.url
    record, hf_record = _records(metadata, url)
    adapter, config = _adapter(record, adapter)
    model = _meta_peft_model(hf_record, config, adapter)
    stored = checkpoint.model_tensors()
    names = {name: record["prefix"] + key for name, key in peft_tensor_names(model, adapter).items()}
    absent = sorted(key for key in names.values() if key not in stored)
    if absent:
        raise ExportError(f"{url!r} lacks adapter tensors of its own peft config: {absent[:10]}.")
    return {name: checkpoint.read_tensor(key) for name, key in names.items()}, adapter, config, model


def export_peft(checkpoint: Any, out: Path, adapter: str | None = None) -> list[Path]:
    """Write `adapter_model.safetensors` and `adapter_config.json` to `out`; see the module docstring."""
    from safetensors.torch import save_file

    tensors, adapter, _, _ = _adapter_tensors(checkpoint, adapter)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(checkpoint.info.metadata[PEFT_MODEL_KEY]["adapters"][adapter])
    return [out / ADAPTER_WEIGHTS, out / ADAPTER_CONFIG]


def export_merged(checkpoint: Any, out: Path, base: str | None = None, adapter: str | None = None) -> list[Path]:
    """Write the merged Hugging Face model to `out`; see the module docstring."""
    metadata, url = checkpoint.info.metadata, checkpoint.info.location.url
    tensors, adapter, config, meta_model = _adapter_tensors(checkpoint, adapter)
    hf_record = require_record(metadata, url)
    adapter_only = metadata.get(DPAR_KEY, {}).get(ADAPTER_ONLY_KEY)
    model = _base_from_directory(hf_record, adapter_only, base, url) if adapter_only is not None else None
    model = _with_checkpoint_base_tensors(checkpoint, hf_record, meta_model, model)
    peft_model = _with_adapter(model, config, adapter)
    loaded = _peft().set_peft_model_state_dict(peft_model, tensors, adapter_name=adapter)
    unexpected = getattr(loaded, "unexpected_keys", [])
    if unexpected:
        raise ExportError(f"peft did not place the adapter tensors {unexpected[:10]}.")
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(out)
    return sorted(out.iterdir())


def _base_from_directory(
    hf_record: Mapping[str, Any], adapter_only: Mapping[str, Any], base: str | None, url: str
) -> nn.Module:
    """The base of an adapter-only checkpoint from `--base`, which must be the one it was trained on."""
    saved_from = adapter_only["base_path"]
    if base is None:
        raise ExportError(
            f"{url!r} is an adapter-only checkpoint: the merge needs its frozen base, which it was trained on from"
            f" {saved_from!r}. Pass --base {saved_from} (or a copy of that directory)."
        )
    if base_fingerprint(base) != adapter_only["base_fingerprint"]:
        raise ExportError(
            f"--base {base!r} holds other weights than the base {url!r} was trained on ({saved_from!r}): the base"
            " fingerprints differ. Pass --base the directory it was trained on."
        )
    model_class, _ = _model_class_and_config(hf_record)
    return model_class.from_pretrained(base, dtype="auto")


def _with_checkpoint_base_tensors(
    checkpoint: Any, hf_record: Mapping[str, Any], meta_model: nn.Module, model: nn.Module | None
) -> nn.Module:
    """The base model with every tensor of it the checkpoint holds, read from where the peft model keeps it
    (`q_proj.weight` under `q_proj.base_layer.weight`): all of them for a full checkpoint (`model` None: built here
    from the record), and for an adapter-only one (`model`: the base from `--base`) what trained besides the
    adapters (a layer norm left trainable) and any frozen tensor its base lacks, which the base must not override."""
    model_class, model_config = _model_class_and_config(hf_record)
    built = model is None
    if model is None:
        with torch.device("meta"):
            model = model_class(model_config)
    stored = checkpoint.model_tensors()
    prefix = hf_record["prefix"]
    renamed = peft_keys.with_base_layers(meta_model.get_base_model(), {name: name for name in model.state_dict()})
    state = {name: checkpoint.read_tensor(prefix + key) for key, name in renamed.items() if prefix + key in stored}
    result = model.load_state_dict(state, strict=False, assign=built)
    tied = {key for group in tied_groups(model) for key in group}
    missing = [key for key in result.missing_keys if key not in tied]
    if built and missing:
        raise ExportError(f"{checkpoint.info.location.url!r} lacks base tensors of its model: {missing[:10]}.")
    model.tie_weights()
    return model


def _model_class_and_config(hf_record: Mapping[str, Any]) -> tuple[Any, Any]:
    """The recorded `transformers` class and its config, built from the record (as `hf_export` checks it)."""
    try:
        import transformers
    except ImportError as error:
        raise ExportError("--format peft and --merge-adapters need `transformers`.") from error
    config_dict = json.loads(hf_record["config"])
    model_class = getattr(transformers, hf_record["class"], None)
    if model_class is None:
        raise ExportError(
            f"The checkpoint holds a {hf_record['class']}, which this transformers {transformers.__version__} lacks."
        )
    return model_class, transformers.CONFIG_MAPPING[config_dict["model_type"]].from_dict(config_dict)
