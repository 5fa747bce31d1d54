"""Adapter-only checkpoints (`checkpoint_weights="trainable"`): save what trains, take the frozen base from
`pretrained=` on resume.

What a save leaves out: the frozen parameters (`requires_grad=False`) that the strategy's `pretrained=` directory
supplies, the "base". Everything else is saved as in a full checkpoint: trainable parameters, every buffer (a frozen
layer's running statistics still change), a frozen parameter the directory lacks (it kept its own initialisation,
which no directory can give back), every optimizer's state (frozen parameters have none), and the resume state
(loops, schedulers, callbacks, RNG streams, data position). Both formats: sharded (each rank writes its shards of
the adapters; async too) and full (rank 0 gathers only the adapters).

What the checkpoint records (`ADAPTER_ONLY_KEY` in the `dpar` record): the base's keys it left out, the directory it
came from, and the base's fingerprint. The fingerprint is a SHA-256 over every tensor of the directory's safetensors
files: its name, dtype, shape and the first and last 64 bytes of its data. It is computed from the files, not the
model: once per run, in milliseconds (two small reads per tensor, whatever the model's size), and on every rank
alone, with no collective, so a resume with the wrong base is refused before any tensor is read. It tells apart
another architecture or size (names, shapes, dtypes) and another set of values for the same architecture (two
trainings or two fine-tunes of one model differ in practically every element, so in the bytes read); it does not
look for corruption inside a tensor (the safetensors reader checks the files' structure). Checksums of the
parameters themselves would need the base loaded first (a collective read) before the check could fail.

On resume (`fit(ckpt_path=...)`, also `validate`/`test`/`predict`), the manager refuses a checkpoint whose base it
cannot get back (no `pretrained=`, or one whose fingerprint differs), on every rank alike before any collective
read; otherwise it reads the base from `pretrained=` into the parallelised model and then the checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from lightning_dpar.checkpoint.errors import CheckpointLoadError
from lightning_dpar.checkpoint.full import FullSource
from lightning_dpar.checkpoint.sharded import ShardedSource
from lightning_dpar.hf_weights import peft_keys
from lightning_dpar.hf_weights.pretrained import PretrainedWeights, match_pretrained, safetensors_files

__all__ = [
    "ADAPTER_ONLY_KEY",
    "WEIGHTS",
    "AdapterOnlySaves",
    "CheckpointWeights",
    "base_fingerprint",
    "base_keys",
    "base_to_restore",
    "check_keys",
    "check_weights_option",
    "frozen_keys",
    "refuse_without_base",
    "required_base",
    "stored_model_keys",
]

#: `checkpoint_weights`: `"all"` saves every parameter (the default), `"trainable"` leaves out the frozen base.
CheckpointWeights = Literal["all", "trainable"]
WEIGHTS = ("all", "trainable")
#: Key of the adapter-only record inside the checkpoint's `dpar` record.
ADAPTER_ONLY_KEY = "adapter_only"
#: Bytes of each tensor's data, at its start and at its end, that the fingerprint reads.
SAMPLE_BYTES = 64


def check_weights_option(weights: str, pretrained: PretrainedWeights | None) -> None:
    """Refuse an unknown `checkpoint_weights`, or `"trainable"` without `pretrained=` (the base could not come back)."""
    if weights not in WEIGHTS:
        raise ValueError(f"`checkpoint_weights={weights!r}` is invalid; use 'all' (every parameter) or 'trainable'.")
    if weights == "trainable" and pretrained is None:
        raise ValueError(
            "`checkpoint_weights='trainable'` leaves the frozen base out of checkpoints, so a resume must read it"
            " from `pretrained=`: pass `pretrained=` the Hugging Face directory of the base model (build the model"
            " from its config; the strategy loads the weights), or use `checkpoint_weights='all'`."
        )


def frozen_keys(module: nn.Module) -> set[str]:
    """State-dict keys of the parameters that do not train (every name of a shared one)."""
    return {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


def base_keys(frozen: Collection[str], supplied: Collection[str]) -> list[str]:
    """What an adapter-only save leaves out: the frozen keys that the pretrained directory supplies."""
    supplied = set(supplied)
    return sorted(key for key in frozen if key in supplied)


def base_fingerprint(path: str) -> str:
    """SHA-256 of a `save_pretrained` directory's tensors: names, dtypes, shapes and the first and last
    `SAMPLE_BYTES` of each tensor's data (see the module docstring for why this and not more)."""
    digest = hashlib.sha256()
    entries = []
    for file in safetensors_files(path):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                start, end = (8 + length + offset for offset in entry["data_offsets"])
                f.seek(start)
                head = f.read(min(SAMPLE_BYTES, end - start))
                f.seek(max(start, end - SAMPLE_BYTES))
                tail = f.read(end - max(start, end - SAMPLE_BYTES))
                entries.append((name, entry["dtype"], entry["shape"], head, tail))
    for name, dtype, shape, head, tail in sorted(entries, key=lambda entry: entry[0]):
        digest.update(f"{name}|{dtype}|{shape}|".encode())
        digest.update(head + b"|" + tail + b"\n")
    return digest.hexdigest()


class AdapterOnlySaves:
    """The save side of `checkpoint_weights="trainable"` for one strategy: which keys its saves leave out (found at
    the first save, from the pretrained directory's headers) and the record they carry."""

    def __init__(self, pretrained: PretrainedWeights) -> None:
        self.pretrained = pretrained
        self._left_out: list[str] | None = None
        self._fingerprint: str | None = None

    def left_out(self, model: nn.Module, held_elsewhere: Sequence[str]) -> list[str]:
        """The base keys a save leaves out; computed once (local: headers only)."""
        if self._left_out is None:
            _, _, mapping = match_pretrained(model, self.pretrained, held_elsewhere)
            # Not missing: matched, tied to a matched name, or an adapter (which no base has: a frozen, inactive
            # adapter of a multi-adapter model is not supplied and stays in the checkpoint).
            supplied = set(model.state_dict()) - set(mapping.missing) - peft_keys.adapter_keys(model)
            self._left_out = base_keys(frozen_keys(model), supplied)
        return self._left_out

    def record(self) -> dict[str, Any]:
        assert self._left_out is not None, "`left_out` runs at the save's first step"
        if self._fingerprint is None:
            self._fingerprint = base_fingerprint(self.pretrained.path)
        return {
            ADAPTER_ONLY_KEY: {
                "base_keys": self._left_out,
                "base_path": str(self.pretrained.path),
                "base_fingerprint": self._fingerprint,
            }
        }

    def model_state(self, model: nn.Module, held_elsewhere: Sequence[str], full: bool) -> dict[str, Any]:
        """The model's state without the base: this rank's shards (sharded format), or, for the full format, whole
        tensors on rank 0 (CPU) and nothing elsewhere, gathering only what is kept; a collective when `full`."""
        left_out = set(self.left_out(model, held_elsewhere))
        kept = {key: value for key, value in get_model_state_dict(model).items() if key not in left_out}
        if not full:
            return kept
        rank_zero = not dist.is_initialized() or dist.get_rank() == 0
        whole = {}
        for key, value in kept.items():
            value = value.full_tensor() if isinstance(value, DTensor) else value  # collective, same order everywhere
            if rank_zero:
                whole[key] = value.detach().cpu() if isinstance(value, torch.Tensor) else value
        return whole


def base_to_restore(
    source: ShardedSource | FullSource,
    pretrained: PretrainedWeights | None,
    model: nn.Module,
    strict: bool,
    url: str,
    held_elsewhere: Callable[[str], bool] = lambda key: False,
) -> list[str]:
    """The base keys to read from `pretrained=` before loading the opened checkpoint `source` into `model` ([] for a
    full checkpoint). Raises `CheckpointLoadError` saying what to pass when the base cannot come back (no
    `pretrained=`, or one whose fingerprint differs from the one the checkpoint was trained on), and, as a load
    does, when the checkpoint and its base do not hold the model's keys (`check_keys`; keys `held_elsewhere`, by
    other pipeline stages, aside). Local, no collective."""
    base = required_base(source.record, pretrained, url)
    if base:
        stored = {key for key in stored_model_keys(source) if not held_elsewhere(key)}
        check_keys(stored, model.state_dict(), base, strict, url)
    return base


def required_base(record: dict[str, Any], pretrained: PretrainedWeights | None, url: str) -> list[str]:
    """The base keys an adapter-only checkpoint's `record` left out ([] for a full checkpoint), once `pretrained` is
    checked to be its base (else `CheckpointLoadError` saying what to pass)."""
    adapter = record.get(ADAPTER_ONLY_KEY)
    if adapter is None:
        return []
    base, saved_from = adapter["base_keys"], adapter["base_path"]
    what = (
        f"{url!r} is an adapter-only checkpoint (`checkpoint_weights='trainable'`): it holds the trained parameters"
        f" but not the {len(base)} frozen base tensors, which it was trained on from {saved_from!r}"
    )
    if pretrained is None:
        raise CheckpointLoadError(
            f"{what}, and this strategy has no `pretrained=` to read them from. Pass"
            f" `pretrained={saved_from!r}` (or a copy of that directory) to the strategy."
        )
    found = base_fingerprint(pretrained.path)
    if found != adapter["base_fingerprint"]:
        raise CheckpointLoadError(
            f"{what}; this strategy's `pretrained={str(pretrained.path)!r}` holds other weights (base fingerprint"
            f" {found[:12]}, the checkpoint's {adapter['base_fingerprint'][:12]}: other tensor names, shapes, dtypes"
            f" or values). Pass `pretrained=` the base it was trained on ({saved_from!r}, or a copy of it)."
        )
    return list(base)


def check_keys(stored: Iterable[str], model_keys: Iterable[str], base: Collection[str], strict: bool, url: str) -> None:
    """Refuse (strict) an adapter-only checkpoint that, together with its base, does not hold exactly the model's
    keys; the base's own keys must be in the model in any case. Local, before any collective."""
    stored, model_keys, base = set(stored), set(model_keys), set(base)
    absent = sorted(base - model_keys)
    if absent:
        raise CheckpointLoadError(
            f"{url!r} left out base tensors the model lacks: {absent[:10]}: it was trained on another model."
        )
    missing, unexpected = sorted(model_keys - stored - base), sorted(stored - model_keys)
    if strict and (missing or unexpected):
        raise CheckpointLoadError(
            f"{url!r} (adapter-only) does not match the model (strict loading). Missing in the checkpoint and its"
            f" base: {missing[:20]}; unexpected in the checkpoint: {unexpected[:20]}. Set `strict_loading = False` on"
            " the LightningModule to load the matching keys only."
        )


def stored_model_keys(source: ShardedSource | FullSource) -> set[str]:
    """The model keys an opened checkpoint holds (read from its index or file, no tensor)."""
    if isinstance(source, ShardedSource):
        return source.info.keys_under(source.info.model_key)
    return set(source.checkpoint.get("state_dict", {}))


def refuse_without_base(record: dict[str, Any], url: str, where: str) -> None:
    """Refuse to read an adapter-only checkpoint where no base can join it (`where`: what was asked), rather than
    leave the base with the model's own initialisation."""
    adapter = record.get(ADAPTER_ONLY_KEY)
    if adapter is not None:
        raise CheckpointLoadError(
            f"{url!r} is an adapter-only checkpoint (`checkpoint_weights='trainable'`): it lacks the frozen base it was"
            f" trained on from {adapter['base_path']!r}, so {where} cannot build the model from it. Load it with a"
            f" Trainer whose strategy has `pretrained={adapter['base_path']!r}` (`validate`/`test`/`predict(ckpt_path"
            "=...)`), or export the adapter: `consolidate CKPT OUT --format peft`, or the merged model with `--format"
            " hf --merge-adapters --base DIR`."
        )
