"""Pretrained weights straight into shards: a Hugging Face `save_pretrained` directory loaded into a model after the
strategy has parallelised it (`DparStrategy(pretrained=...)`).

Every rank asks DCP for the pieces of each tensor it holds (an FSDP shard, a tensor-parallel slice, or the whole
tensor under `dpar_replicate`), and DCP's `HuggingFaceStorageReader` reads exactly those slices from the safetensors
files (`safe_open(...).get_slice`), file by file, into the parameters in place. No rank reads or allocates the full
model, so a model built on the meta device (`empty_init=True`) never exists unsharded anywhere.

Checkpoint keys are the model's own names (`model.layers.0.self_attn.q_proj.weight`); the LightningModule holds the
model somewhere (`self.model`, `self.net`), so its keys carry a prefix (`model.`, `net.`). The prefix is inferred by
matching the checkpoint's keys against the LightningModule's, or given explicitly.

A mixture-of-experts checkpoint that stores one tensor per expert (`mlp.experts.3.gate_proj.weight`, what
`save_pretrained` writes) for a model whose experts are fused (`mlp.experts.gate_up_proj` [E, 2I, H]) is read the same
way: each fused parameter counts as one checkpoint key (`lightning_dpar.experts.keys`), and `FusedExpertsReader`
(`lightning_dpar.experts.reader`) fills each rank's block of it from the per-expert slices inside the block.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

import lightning_dpar.hf_weights.hf_keys as hf_keys
import lightning_dpar.hf_weights.peft_keys as peft_keys
from lightning_dpar.experts.keys import FusedExperts, group_experts
from lightning_dpar.experts.reader import FusedExpertsReader
from lightning_dpar.helpers import class_name, is_under, show_names, transformers_models
from lightning_dpar.hf_weights.key_matching import KeyMapping, describe, map_keys, tied_groups

__all__ = [
    "PretrainedLoad",
    "PretrainedLoadError",
    "PretrainedSpec",
    "PretrainedWeights",
    "TensorHeader",
    "checkpoint_headers",
    "checkpoint_item_sizes",
    "checkpoint_shapes",
    "infer_prefix",
    "load_pretrained",
    "load_unless_resuming",
    "match_pretrained",
    "read_pretrained",
    "safetensors_files",
    "stored_names",
    "to_pretrained_weights",
]

INDEX_FILENAME = "model.safetensors.index.json"
SINGLE_FILENAME = "model.safetensors"


class PretrainedLoadError(ValueError):
    """The pretrained directory does not fit the model (missing, unexpected or mis-shaped keys, or no weights)."""


@dataclass(frozen=True)
class PretrainedWeights:
    """Where the weights are and how their keys map onto the LightningModule.

    Args:
        path: a `save_pretrained` directory: `model.safetensors`, or `model-0000i-of-0000n.safetensors` files with
            `model.safetensors.index.json`.
        prefix: what the LightningModule's keys put in front of the checkpoint's (`"model."` when the Hugging Face
            model is `self.model`; `""` when the keys already match). `None`: inferred from the keys.
        strict: refuse a checkpoint that lacks a key of the model or has a key the model lacks. With `False`,
            parameters the checkpoint lacks keep the model's own initialisation (after materialisation from the
            meta device, `reset_parameters()`), and the keys left out are reported.
    """

    path: str
    prefix: str | None = None
    strict: bool = True


#: The strategy argument: a directory (a `str`; an `os.PathLike` works too) or a `PretrainedWeights`.
PretrainedSpec = Union[str, PretrainedWeights]


def to_pretrained_weights(spec: PretrainedSpec | os.PathLike | None) -> PretrainedWeights | None:
    """A `PretrainedWeights` from the strategy argument (a path, or one already built); checks the directory."""
    if spec is None:
        return None
    weights = spec if isinstance(spec, PretrainedWeights) else PretrainedWeights(path=os.fspath(spec))
    safetensors_files(weights.path)  # fail at construction, before any process is launched
    return weights


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The weight files of a `save_pretrained` directory, as its index lists them (or the single file)."""
    directory = Path(path)
    index = directory / INDEX_FILENAME
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({directory / name for name in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise PretrainedLoadError(f"{str(index)!r} lists weight files that are missing: {absent}.")
    elif (directory / SINGLE_FILENAME).is_file():
        files = [directory / SINGLE_FILENAME]
    else:
        what = "does not exist" if not directory.exists() else "holds no weights"
        raise PretrainedLoadError(
            f"Pretrained directory {str(directory)!r} {what}: expected {SINGLE_FILENAME!r}, or sharded safetensors"
            f" files with {INDEX_FILENAME!r}, as `save_pretrained` writes them. PyTorch `.bin` weights are not read:"
            " convert them with `save_pretrained(..., safe_serialization=True)`."
        )
    # DCP's reader takes every safetensors file of the directory: a stray one would mix other weights in.
    stray = sorted(p.name for p in directory.glob("*.safetensors") if p not in files)
    if stray:
        raise PretrainedLoadError(
            f"{str(directory)!r} holds safetensors files besides the model's {[f.name for f in files]}: {stray}. Move"
            " them out of the directory (a leftover of an earlier save?)."
        )
    return files


@dataclass(frozen=True)
class TensorHeader:
    """What a safetensors header says of one tensor: its file, shape and dtype (`"F32"`, `"BF16"`, ...)."""

    file: str
    shape: tuple[int, ...]
    dtype: str


def checkpoint_headers(path: str | os.PathLike) -> dict[str, TensorHeader]:
    """Every tensor's file, shape and dtype, from the safetensors headers only (no tensor data is read)."""
    from safetensors import safe_open

    headers: dict[str, TensorHeader] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                info = f.get_slice(key)
                headers[key] = TensorHeader(str(file), tuple(info.get_shape()), info.get_dtype())
    return headers


def checkpoint_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, from the safetensors headers only (no tensor data is read)."""
    return {key: header.shape for key, header in checkpoint_headers(path).items()}


def infer_prefix(model_keys: Sequence[str], checkpoint_keys: Sequence[str]) -> str:
    """The prefix `p` for which most checkpoint keys `k` have `p + k` among the model's keys.

    `p` is a run of whole name segments ending in a dot (`"model."`, `"net.backbone."`) or empty. A tie between two
    prefixes is ambiguous and an error; so is a checkpoint none of whose keys is found under any prefix.
    """
    prefixes_by_suffix: dict[str, list[str]] = {}
    for key in model_keys:
        parts = key.split(".")
        for i in range(len(parts)):
            prefixes_by_suffix.setdefault(".".join(parts[i:]), []).append(".".join(parts[:i]) + ("." if i else ""))
    votes = Counter(prefix for key in checkpoint_keys for prefix in prefixes_by_suffix.get(key, ()))
    if not votes:
        ours, theirs = show_names(checkpoint_keys, 3, bracketed=False), show_names(model_keys, 3, bracketed=False)
        raise PretrainedLoadError(
            f"None of the checkpoint's keys (e.g. {ours}) is a key of the LightningModule (e.g. {theirs}) under any"
            " prefix: the directory holds another model's weights."
        )
    ranked = votes.most_common()
    best, count = ranked[0]
    tied = [prefix for prefix, n in ranked if n == count]
    if len(tied) > 1:
        raise PretrainedLoadError(
            f"The checkpoint's keys fit the LightningModule's under several prefixes equally well: {tied}. Give the"
            " one meant as `PretrainedWeights(path, prefix=...)`."
        )
    return best


@dataclass
class PretrainedLoad:
    """What one rank's `load_pretrained` did: which keys it matched, and what it read in how long."""

    weights: PretrainedWeights
    prefix: str
    mapping: KeyMapping
    bytes_read: int  # this rank's slices of the tensors, in the checkpoint's dtypes
    seconds: float
    expert_slices: list[str] = field(default_factory=list)  # the per-expert slices read, `'name[0:16, 0:32]'`

    def summary(self) -> str:
        """The one line the strategy logs on rank 0."""
        where = f" into `{self.prefix.rstrip('.')}`" if self.prefix else ""
        return (
            f"Loaded pretrained weights {self.weights.path!r}{where}: {len(self.mapping.to_model)} tensors in"
            f" {self.seconds:.2f} s; this rank read {_size(self.bytes_read)} of them (its shards)."
        )


def match_pretrained(
    module: nn.Module,
    weights: PretrainedWeights,
    held_elsewhere: Sequence[str] = (),
    tied: Sequence[Sequence[str]] | None = None,
    state: Mapping[str, object] | None = None,
) -> tuple[dict[str, str], str, KeyMapping]:
    """Which tensor of `weights` fills which key of `module`, from the safetensors headers only (no tensor is read;
    local, no collective): `({name as loaded: name in the files}, prefix, mapping)`. Adapter parameters a `peft`
    model adds (`lora_A`, `lora_B`) are not base weights, so no checkpoint has them: never counted as missing. A
    fused expert parameter the checkpoint stores per expert is one key, its own name in both places (the reader
    assembles it); per-expert tensors that do not make the model's parameter exactly are `mapping.incomplete`."""
    stored_as, prefix, mapping, _ = _match(module, weights, held_elsewhere, tied, state)
    return stored_as, prefix, mapping


def _match(
    module: nn.Module,
    weights: PretrainedWeights,
    held_elsewhere: Sequence[str],
    tied: Sequence[Sequence[str]] | None,
    state: Mapping[str, object] | None,
) -> tuple[dict[str, str], str, KeyMapping, dict[str, FusedExperts]]:
    """`match_pretrained`, and every fused expert parameter the checkpoint stores per expert."""
    checkpoint = checkpoint_shapes(weights.path)
    stored_as = stored_names(module, list(checkpoint))
    loaded = {name: checkpoint[stored] for name, stored in stored_as.items()}
    models = transformers_models(module)
    merges = hf_keys.model_expert_merges(models[0][1]) if len(models) == 1 else []
    loaded, fused, conflicts = group_experts(loaded, merges)
    stored_as.update({name: name for name in fused})  # the reader serves a fused parameter under its own name
    state = module.state_dict() if state is None else state
    model_shapes = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
    prefix = weights.prefix if weights.prefix is not None else infer_prefix(list(model_shapes), list(loaded))
    loaded = {k: shape for k, shape in loaded.items() if not is_under(prefix + k, held_elsewhere)}
    mapping = map_keys(model_shapes, loaded, prefix, tied_groups(module) if tied is None else tied)
    adapters = peft_keys.adapter_keys(module)
    mapping.missing = [key for key in mapping.missing if key not in adapters]
    mapping.incomplete = list(conflicts)
    in_files = hf_keys.name_in_files(models[0][1] if len(models) == 1 else None, stored_as)
    for name, group in fused.items():
        if name not in loaded or prefix + name not in model_shapes:
            continue
        problems = group.check(model_shapes[prefix + name], in_files, prefix + name)
        if problems:  # named per expert tensor instead of as one fused shape
            mapping.incomplete += problems
            mapping.to_model.pop(name, None)
            mapping.mismatched = [line for line in mapping.mismatched if not line.startswith(f"{name}: ")]
    return stored_as, prefix, mapping, fused


def load_pretrained(
    module: nn.Module,
    weights: PretrainedWeights,
    held_elsewhere: Sequence[str] = (),
    tied: Sequence[Sequence[str]] | None = None,
) -> PretrainedLoad:
    """Read `weights` into the parallelised `module` in place; every rank calls it (DCP plans collectively).

    `held_elsewhere` names the units other ranks hold entirely (other pipeline stages): the checkpoint's weights for
    them are neither read here nor unexpected. `tied` is the model's tied names as found before parallelism (the
    plan's); default: the parameters `module` shares now. Raises `PretrainedLoadError` on every rank, before any
    tensor is read, if the keys do not fit (strict), a shape differs, or nothing matches. Returns what was loaded: the
    mapping, whose `missing`/`unexpected` say what a non-strict load left out, and the bytes this rank read and how
    long it took.
    """
    import torch.distributed.checkpoint as dcp

    start = time.perf_counter()
    state = module.state_dict()  # DTensor shards / local tensors sharing storage with the parameters
    stored_as, prefix, mapping, fused = _match(module, weights, held_elsewhere, tied, state)
    problems = mapping.problems(weights.strict)
    if not mapping.to_model:
        problems.append(f"no key of the checkpoint is a key of the model under the prefix {prefix!r}")
    if problems:
        advice = " Pass `PretrainedWeights(path, prefix=..., strict=False)` to load only the keys that match."
        if mapping.incomplete:  # strict=False does not help there
            advice = (
                " A fused expert parameter loads from all of its per-expert tensors or not at all: complete the"
                " directory (every expert, as `save_pretrained` writes it), or build the model from the directory's"
                f" `config.json`.{advice if len(problems) > len(mapping.incomplete) else ''}"
            )
        raise PretrainedLoadError(
            f"Pretrained weights {weights.path!r} do not fit {class_name(module)} (keys matched with the prefix"
            f" {prefix!r}): {'; '.join(problems)}.{advice}"
        )
    targets = {stored_as[key]: state[model_key] for key, model_key in mapping.to_model.items()}
    headers = checkpoint_headers(weights.path)
    files = {key: header.file for key, header in headers.items()}
    # Every rank the same reader and metadata (all fused parameters), whichever of them it loads.
    reader = FusedExpertsReader(str(weights.path), fused, stored_as, files) if fused else None
    with torch.no_grad():
        dcp.load(targets, storage_reader=reader or dcp.HuggingFaceStorageReader(str(weights.path)))
    item_sizes = {key: SAFETENSORS_ITEM_SIZES.get(header.dtype, 4) for key, header in headers.items()}
    item_sizes |= {name: item_sizes[stored_as[group.first_key]] for name, group in fused.items()}
    read = sum(_local_numel(target) * item_sizes[key] for key, target in targets.items())
    slices = reader.slices_read if reader is not None else []
    return PretrainedLoad(weights, prefix, mapping, read, time.perf_counter() - start, slices)


def load_unless_resuming(
    module: nn.Module,
    weights: PretrainedWeights,
    ckpt_path: object,
    held_elsewhere: Sequence[str] = (),
    tied: Sequence[Sequence[str]] | None = None,
) -> None:
    """The strategy's load (`DparStrategy(pretrained=...)`), once the model is parallelised: skipped when a
    checkpoint (`ckpt_path`) is about to replace the weights; otherwise `load_pretrained`, logging what it read and,
    for a non-strict load, what it left out."""
    if ckpt_path is not None:
        rank_zero_info(
            f"Resuming from {ckpt_path!r}: the pretrained weights are not read (an adapter-only checkpoint's frozen"
            " base is, before the checkpoint)."
        )
        return
    read_pretrained(module, weights, held_elsewhere, tied)


def read_pretrained(
    module: nn.Module,
    weights: PretrainedWeights,
    held_elsewhere: Sequence[str] = (),
    tied: Sequence[Sequence[str]] | None = None,
) -> None:
    """`load_pretrained` into the parallelised parameters (collective), logging what it read and, for a non-strict
    load, what it left out: the strategy's first load, and an adapter-only checkpoint's frozen base on resume."""
    loaded = load_pretrained(module, weights, held_elsewhere, tied)
    rank_zero_info(loaded.summary())
    if loaded.mapping.missing or loaded.mapping.unexpected:
        rank_zero_warn(f"Loaded {weights.path!r} with `strict=False`: {describe(loaded.mapping)}.")


#: Bytes per element of each safetensors dtype.
SAFETENSORS_ITEM_SIZES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2}
SAFETENSORS_ITEM_SIZES |= {"I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def checkpoint_item_sizes(path: str | os.PathLike) -> dict[str, int]:
    """Every tensor's bytes per element as stored, from the safetensors headers only."""
    return {key: SAFETENSORS_ITEM_SIZES.get(header.dtype, 4) for key, header in checkpoint_headers(path).items()}


def _local_numel(tensor: torch.Tensor) -> int:
    """Elements of the tensor this rank holds (a DTensor's local shard)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local().numel() if to_local is not None else tensor.numel()


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def stored_names(module: nn.Module, checkpoint_names: Sequence[str]) -> dict[str, str]:
    """`{the name transformers loads a checkpoint tensor as: its name in the files}`: the renames of the one
    transformers model `module` holds (GPT-NeoX's `embed_out` is `lm_head`; see `lightning_dpar.hf_weights.hf_keys`),
    else the names as they are; a weight of a layer `peft` wrapped is loaded under its `base_layer`
    (`lightning_dpar.hf_weights.peft_keys`)."""
    models = transformers_models(module)
    if len(models) != 1:
        return peft_keys.with_base_layers(module, {name: name for name in checkpoint_names})
    by_loaded: dict[str, str] = {}
    for stored, loaded in hf_keys.loaded_names(models[0][1], checkpoint_names).items():
        if loaded in by_loaded:
            raise PretrainedLoadError(
                f"The checkpoint holds both {by_loaded[loaded]!r} and {stored!r}, which transformers both loads as"
                f" {loaded!r} into {hf_keys.library_class_name(models[0][1])}: remove one of them."
            )
        by_loaded[loaded] = stored
    return peft_keys.with_base_layers(models[0][1], by_loaded)
