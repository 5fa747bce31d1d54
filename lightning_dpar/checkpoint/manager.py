"""The single owner of checkpointing for one strategy: saving (sharded or full, in the foreground or background),
removing superseded checkpoints, loading into the parallelised model, and the resume state a load leaves behind.

The strategy's checkpoint hooks each delegate here in a line or two; nothing about checkpoints lives elsewhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Literal, Protocol

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.optim import Optimizer

import lightning_dpar.checkpoint.adapter_only as adapter_only
from lightning_dpar.agreement import first_problem
from lightning_dpar.checkpoint.contents import LoadReport
from lightning_dpar.checkpoint.errors import CheckpointLoadError, CheckpointSaveError
from lightning_dpar.checkpoint.full import FullFormat
from lightning_dpar.checkpoint.resume import (
    RNG_STATES_KEY,
    ResumeState,
    align_loop_state,
    capture_rng_state,
    skip_seen_batches,
)
from lightning_dpar.checkpoint.sharded import ShardedFormat
from lightning_dpar.checkpoint.storage import Location
from lightning_dpar.checkpoint.writer import CheckpointWriter
from lightning_dpar.helpers import is_under
from lightning_dpar.hf_weights.pretrained import PretrainedWeights, load_unless_resuming, read_pretrained

__all__ = ["CheckpointFormatName", "CheckpointManager"]

log = logging.getLogger(__name__)

CheckpointFormatName = Literal["sharded", "full"]


class _Source(Protocol):
    """A checkpoint validated for loading: our record, Lightning's part, and how to load the rest in place."""

    record: dict[str, Any]
    rest: dict[str, Any]

    def load(
        self, model: nn.Module, optimizers: Sequence[Optimizer], strict: bool, elsewhere: Callable[[str], bool]
    ) -> LoadReport: ...


class _Format(Protocol):
    """What a checkpoint format provides: the state each rank hands to a save, the save, and opening for a load.

    A save writes `record` with, for each key of `per_rank` (this rank's values), the list of every rank's value in
    rank order."""

    name: str

    def model_state(self, model: nn.Module) -> dict[str, Any]: ...
    def optimizer_state(self, model: nn.Module, optimizer: Optimizer) -> dict[str, Any]: ...
    def save(
        self,
        checkpoint: dict[str, Any],
        record: dict[str, Any],
        per_rank: dict[str, Any],
        path: str,
        writer: CheckpointWriter,
    ) -> None: ...
    @staticmethod
    def open(location: Location, rank: int, world_size: int) -> _Source: ...


_FORMATS: dict[str, _Format] = {"sharded": ShardedFormat(), "full": FullFormat()}


class CheckpointManager:
    """Save, remove, load and resume for one strategy. `checkpoint_format` picks how saves are written; loads read
    either format, whichever the path holds."""

    def __init__(
        self,
        checkpoint_format: CheckpointFormatName,
        async_save: bool,
        timeout: timedelta | None = None,
        weights: adapter_only.CheckpointWeights = "all",
        pretrained: PretrainedWeights | None = None,
    ) -> None:
        if checkpoint_format not in _FORMATS:
            raise ValueError(f"`checkpoint_format={checkpoint_format!r}` is invalid; use 'sharded' or 'full'.")
        adapter_only.check_weights_option(weights, pretrained)
        #: Where the frozen base of an adapter-only checkpoint comes back from (`checkpoint.adapter_only`).
        self.pretrained = pretrained
        self.adapter_only = adapter_only.AdapterOnlySaves(pretrained) if weights == "trainable" and pretrained else None
        self.format: _Format = _FORMATS[checkpoint_format]
        self.writer = CheckpointWriter(timeout=timeout)
        self.resume = ResumeState()
        self.async_save = async_save
        self._keys_held_elsewhere: Sequence[str] = ()
        self._pipeline_group: dist.ProcessGroup | None = None

    # ------------------------------------------------------------------ configuration
    def hold_pipeline_stages(self, keys_held_elsewhere: Sequence[str], pipeline_group: dist.ProcessGroup) -> None:
        """This rank holds some pipeline stages only: `keys_held_elsewhere` names the units (FQN prefixes) other
        ranks hold entirely, whose checkpoint keys are neither loaded here nor unexpected; `pipeline_group` joins the
        stages, each of whose optimizers knows only its own parameters."""
        self._keys_held_elsewhere = tuple(keys_held_elsewhere)
        self._pipeline_group = pipeline_group

    @property
    def keys_held_elsewhere(self) -> Sequence[str]:
        """Units whose parameters other ranks hold entirely (other pipeline stages); empty without pipelining."""
        return self._keys_held_elsewhere

    @property
    def async_save(self) -> bool:
        return self.writer.async_save

    @async_save.setter
    def async_save(self, enabled: bool) -> None:
        if enabled and self.format.name != "sharded":
            raise ValueError(
                f"`async_save=True` needs `checkpoint_format='sharded'`, not {self.format.name!r}: "
                "a full checkpoint is gathered to rank 0 and written there."
            )
        self.writer.async_save = enabled

    # ------------------------------------------------------------------ saving
    def model_state(self, model: nn.Module) -> dict[str, Any]:
        if self.adapter_only is not None:  # `checkpoint_weights="trainable"`: without the frozen base
            return self.adapter_only.model_state(model, self.keys_held_elsewhere, full=self.format.name == "full")
        return self.format.model_state(model)

    def optimizer_state(self, model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
        state = self.format.optimizer_state(model, optimizer)
        if self._pipeline_group is not None:
            state["param_groups"] = _param_groups_of_all_stages(state["param_groups"], self._pipeline_group)
        return state

    def save(self, checkpoint: dict[str, Any], path: Any, record: dict[str, Any]) -> None:
        """Write Lightning's `checkpoint` plus our `record` to rank 0's `path` (callbacks may format per-rank paths);
        collective.

        Every rank's RNG streams go into the record too. They are captured here, at save time (local and cheap), and
        handed to the format as this rank's `per_rank` values, which it gathers to rank 0 on a collective it performs
        anyway (the sharded writer's finishing step, in the background for async saves): no collective of its own
        in front of the save."""
        self.writer.wait()  # a full save after an async one: one save at a time
        per_rank = {RNG_STATES_KEY: capture_rng_state()}
        if self.adapter_only is not None:
            record = {**record, **self.adapter_only.record()}
        self.format.save(checkpoint, record, per_rank, str(path), self.writer)

    def remove(self, path: Any, is_global_zero: bool) -> None:
        """A checkpoint `ModelCheckpoint` no longer keeps; removed only once no save it depends on is in flight."""
        self.writer.remove(Location.parse(str(path)), is_global_zero)

    def link(self, target: Any, link: Any, is_global_zero: bool) -> bool:
        """Point `link` (`last.ckpt` of `ModelCheckpoint(save_last="link")`) at `target` once `target` is published;
        returns whether that was deferred to a background save's end (the same on every rank)."""
        return self.writer.link(Location.parse(str(target)), Location.parse(str(link)), is_global_zero)

    def wait(self) -> None:
        self.writer.wait()

    def close(self) -> None:
        self.writer.close()

    # ------------------------------------------------------------------ loading
    def load_pretrained(self, model: nn.Module, ckpt_path: object, tied: Sequence[Sequence[str]] = ()) -> None:
        """The strategy's `pretrained=` weights into the parallelised `model` (collective), unless `ckpt_path` (a
        checkpoint about to be loaded) replaces them. The one way pretrained weights enter: this, and `load` for an
        adapter-only checkpoint's frozen base."""
        if self.pretrained is not None:
            load_unless_resuming(model, self.pretrained, ckpt_path, self._keys_held_elsewhere, tied)

    def load(
        self,
        path: Any,
        model: nn.Module,
        optimizers: Sequence[Optimizer],
        strict: bool,
        fitting: bool,
        iteration_based: bool = False,
        tied: Sequence[Sequence[str]] = (),
    ) -> dict:
        """Load model (and the given optimizers') state in place, resharding to this layout; keep the resume record
        for `fit`; return Lightning's part of the checkpoint. Every rank validates, and the ranks agree on the
        outcome before any collective read, so a bad checkpoint raises the same error everywhere. An adapter-only
        checkpoint's frozen base is read first from `pretrained=` (`tied`: the model's tied parameters,
        `ModulePlan.tied`)."""
        self.writer.wait()  # the checkpoint may be the one still being written
        location = Location.parse(_from_rank_zero(str(path)))
        rank = dist.get_rank() if dist.is_initialized() else 0
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        source, own_error, base = None, None, []
        try:
            source = _FORMATS["sharded" if location.is_dir() else "full"].open(location, rank, world_size)
            base = adapter_only.base_to_restore(
                source, self.pretrained, model, strict, location.url, self._held_elsewhere
            )
        except CheckpointLoadError as error:
            own_error = error
        problem = first_problem(str(own_error) if own_error is not None else None)
        if problem is not None:  # the rank that found it keeps its type (`UnsafeCheckpointError`, ...)
            raise own_error if own_error is not None and str(own_error) == problem else CheckpointLoadError(problem)
        assert source is not None
        if base:  # checked above: the same base the checkpoint was trained on
            assert self.pretrained is not None
            read_pretrained(model, self.pretrained, self._keys_held_elsewhere, tied)
        report = source.load(model, optimizers, strict and not base, self._held_elsewhere)
        report.missing = [key for key in report.missing if key not in frozenset(base)]
        if report.missing or report.unexpected:
            rank_zero_warn(
                f"Loaded {location.url!r} with `strict_loading=False`. Keys of the model not in the checkpoint (left"
                f" as they were): {report.missing}. Keys of the checkpoint not in the model (ignored):"
                f" {report.unexpected}."
            )
        self.resume.pending = source.record if fitting else {}  # RNG and data position apply to `fit` only
        if fitting:
            # before Lightning restores its loops from it
            self.resume.loop_note, self.resume.reruns_epoch_end = align_loop_state(source.rest, iteration_based)
        return source.rest

    # ------------------------------------------------------------------ resuming
    def record(self, trainer: Any, strategy_name: str, world_size: int, data_parallel_size: int | None) -> dict:
        """Our part of the next save's metadata: layout and data position (`ResumeState.record`); local."""
        return self.resume.record(trainer, strategy_name, world_size, data_parallel_size)

    def resumes_mid_epoch(self) -> bool:
        """Whether the checkpoint just loaded for `fit` was saved in the middle of an epoch."""
        return self.resume.mid_epoch

    def position_loader(self, dataloader: object, data_parallel_size: int | None) -> None:
        """Make the training loader resumable mid-epoch and position it where the loaded checkpoint left off; for a
        mid-epoch resume, the line saying how it resumes is logged by `start_training`, once the loop is set."""
        mid_epoch = self.resume.mid_epoch
        how, exact = self.resume.position_loader(dataloader, data_parallel_size)
        if mid_epoch:
            self.resume.announcement = (how, exact)

    def start_training(self, trainer: Any | None, world_size: int, global_rank: int) -> str | None:
        """Right before training continues (after loaders and sanity checks): log how a mid-epoch resume goes, skip
        the batches a custom sampler already gave, and restore this rank's RNG streams. Returns a note when the
        streams cannot be mapped to this world size."""
        if trainer is not None:
            self.resume.announce(trainer)
            skip_seen_batches(self.resume, trainer)
        return self.resume.restore_rng(world_size, global_rank)

    def _held_elsewhere(self, key: str) -> bool:
        return is_under(key, self._keys_held_elsewhere)


def _param_groups_of_all_stages(groups: list[dict[str, Any]], pipeline_group: dist.ProcessGroup) -> list[dict]:
    """Every stage's optimizer groups merged into the unpipelined optimizer's: group i holds the parameters of
    group i of every stage, in stage order (a collective over the stages).

    A checkpoint stores one copy of the groups (every rank writes the same key), so without this the stored groups
    would name one stage's parameters only, and loading under another layout or consolidating would lose the others.
    """
    every_stage: list[Any] = [None] * dist.get_world_size(pipeline_group)
    dist.all_gather_object(every_stage, groups, group=pipeline_group)
    counts = {len(stage_groups) for stage_groups in every_stage}
    if len(counts) != 1:
        raise CheckpointSaveError(
            f"The pipeline stages' optimizers have different numbers of parameter groups ({sorted(counts)}); a"
            " checkpoint needs the same groups on every stage. Build the groups in `configure_optimizers` from"
            " rules that give every stage each group (an empty group is fine)."
        )
    merged = []
    for index, stage_groups in enumerate(zip(*every_stage)):
        options = [{k: v for k, v in group.items() if k != "params"} for group in stage_groups]
        if any(option != options[0] for option in options):
            raise CheckpointSaveError(
                f"Parameter group {index} has different options on different pipeline stages ({options}); a"
                " checkpoint stores one set per group. Give the group the same options on every stage."
            )
        merged.append({**options[0], "params": [name for group in stage_groups for name in group["params"]]})
    return merged


def _from_rank_zero(text: str) -> str:
    """Rank 0's value on every rank (callbacks may format per-rank paths, e.g. with a timestamp)."""
    if not dist.is_initialized():
        return text
    holder = [text]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
