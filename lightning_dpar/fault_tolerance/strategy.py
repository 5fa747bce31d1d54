"""Fault tolerance composed with any of the package's strategies: `FaultTolerantHooks`, put in front of a strategy
class by `with_fault_tolerance` when the strategy is given `fault_tolerance=FaultTolerance(...)` (as it is given
`context_parallel_size`), makes each launch one torchft replica group (FSDP, HSDP, tensor, context or pipeline
parallelism stay inside the group) and averages gradients across the groups in each step's quorum. The
LightningModule does not change. See docs/fault_tolerance.md for the step semantics.

Lightning hooks it adds to (each delegating to `replica_group`, `healing` and `checks`):

- `_check_before_collectives`: the config resolved and the layout checked, torchft importable, the lighthouse
  reachable, all before any collective (`checks`);
- `distributed_sampler_kwargs` / `sampler_shards`: group `g` of `G` takes shard `g` of each global batch, as
  data-parallel ranks `g * dp .. g * dp + dp - 1` of a `G * dp`-rank HSDP run would;
- `setup`: the `Manager` made and the first quorum taken, so a relaunched group heals before its loop starts;
- `on_train_batch_start`: what a peer would send if it healed now (loop progress, data position, RNG);
- `optimizer_step`: quorum, gradients averaged across groups after the closure, the step only if committed (a step
  the non-finite guard skipped, `on_nonfinite="skip"`, is not committed: the group votes against it);
- `save_checkpoint` / `remove_checkpoint`: only the first group of the quorum writes.

The registered `dpar_ft_hsdp`, `dpar_ft_replicate` and `dpar_ft_2d` are `FullyShardStrategy`, `ReplicateStrategy` and
`FSDPTensorParallelStrategy` composed this way (`lightning_dpar.FaultTolerantFullyShardStrategy`, ...).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dpar.checkpoint.resume import capture_rng_state, restore_rng_state
from lightning_dpar.fault_tolerance.checks import check_fault_tolerance, check_trainer
from lightning_dpar.fault_tolerance.config import FaultTolerance
from lightning_dpar.fault_tolerance.healing import (
    apply_model_state,
    apply_optimizer_state,
    model_state,
    optimizer_state,
    payload_bytes,
)
from lightning_dpar.fault_tolerance.replica_group import HealRecord, ReplicaGroups
from lightning_dpar.helpers import attached_trainer

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_dpar.parallel_dims import ParallelDims

__all__ = ["FaultTolerantHooks", "compose_fault_tolerance", "with_fault_tolerance"]

StrategyClass = TypeVar("StrategyClass", bound=type)

#: Lightning's batch progress under the fit loop's state dict.
_BATCH_PROGRESS = "epoch_loop.batch_progress"


class _CommitGate:
    """The optimizer as the precision plugin sees it: `step(closure)` runs the closure (forward, backward, the
    average across groups, clipping), then steps the real optimizer only if torchft commits the step."""

    def __init__(self, optimizer: Optimizer, commit: Callable[[], bool]) -> None:
        self._optimizer = optimizer
        self._commit = commit

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        output = closure() if closure is not None else None
        if self._commit():
            self._optimizer.step(**kwargs)
        return output

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


class FaultTolerantHooks(ParallelStrategy):
    """The fault-tolerant hooks; put in front of one of the package's strategies by `with_fault_tolerance` (see the
    module docstring). A `ParallelStrategy` itself, so a strategy composed with it keeps its object layout
    (`compose_fault_tolerance` changes an existing strategy's class)."""

    #: The name the strategy registers with Lightning, and its description (the registered `dpar_ft_*` strategies).
    strategy_name: str
    strategy_description: str

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register a class `with_fault_tolerance` gave a name of its own (`dpar_ft_hsdp`); others are reached by
        their strategy's name with `fault_tolerance=` (`dpar_auto`'s stays `dpar_auto`'s)."""
        if "strategy_description" in vars(cls):
            strategy_registry.register(cls.strategy_name, cls, description=cls.strategy_description, override=True)
            cls.register_class_names(strategy_registry)  # type: ignore[attr-defined]

    def __init__(self, *args: Any, fault_tolerance: FaultTolerance | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._start_fault_tolerance(fault_tolerance)

    def _start_fault_tolerance(self, fault_tolerance: FaultTolerance | None) -> None:
        """The hooks' state, `fault_tolerance` checked (`None`: everything from the environment)."""
        if fault_tolerance is not None and not isinstance(fault_tolerance, FaultTolerance):
            raise TypeError(
                f"`fault_tolerance={fault_tolerance!r}` is invalid: expected a"
                " `lightning_dpar.fault_tolerance.FaultTolerance` (or None: everything from the environment)."
            )
        self._fault_tolerance = fault_tolerance or FaultTolerance()
        #: This rank's part in the replica groups, made in `setup` when fitting.
        self.replica_groups: ReplicaGroups | None = None
        self._heal_position: dict[str, Any] | None = None
        self._joining = False
        self._rng_after_heal: dict[str, Any] | None = None
        #: The live groups' batch this group joined at by healing (None: it started with the others).
        self._joined_at_batch: int | None = None

    @property
    def fault_tolerance(self) -> FaultTolerance:
        """The config, resolved from the environment once the ranks are known (`setup_environment`)."""
        return self._fault_tolerance

    # ------------------------------------------------------------------ before any collective
    @override
    def _check_before_collectives(self, dims: ParallelDims) -> None:
        super()._check_before_collectives(dims)  # type: ignore[misc]
        self._fault_tolerance = check_fault_tolerance(self._fault_tolerance, dims)
        check_trainer(attached_trainer(self.lightning_module))  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ data
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        own = super().distributed_sampler_kwargs  # type: ignore[misc]
        config = self._fault_tolerance
        assert config.replica_group is not None and config.num_replica_groups is not None
        return {
            "num_replicas": own["num_replicas"] * config.num_replica_groups,
            "rank": config.replica_group * own["num_replicas"] + own["rank"],
        }

    @override
    def sampler_shards(self) -> int | None:
        shards = super().sampler_shards()  # type: ignore[misc]
        groups = self._fault_tolerance.num_replica_groups
        return shards * groups if shards is not None and groups is not None else shards

    # ------------------------------------------------------------------ joining
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)  # type: ignore[misc]
        live = self.replica_groups is not None and not self.replica_groups.closed
        if trainer.state.fn != TrainerFn.FITTING or live:
            return
        check_trainer(trainer, self.optimizers)  # type: ignore[attr-defined]
        dims = self.dims  # type: ignore[attr-defined]
        self.replica_groups = ReplicaGroups(
            self._fault_tolerance,
            group_rank=self.global_rank,  # type: ignore[attr-defined]
            group_size=dims.world_size,
            device=self.root_device,  # type: ignore[attr-defined]
            state_dict=self._healing_payload,
            load_state_dict=self._heal,
        )
        self._joining = True
        try:
            self.replica_groups.join()
        finally:
            self._joining = False

    def _healing_payload(self) -> dict[str, Any]:
        """What this rank sends a recovering peer (see `lightning_dpar.fault_tolerance.healing`)."""
        trainer = attached_trainer(self.lightning_module)  # type: ignore[attr-defined]
        schedulers = trainer.lr_scheduler_configs if trainer is not None else []
        return {
            "model": model_state(self.lightning_module),  # type: ignore[attr-defined]
            "optimizer": optimizer_state(self.optimizers[0]),  # type: ignore[attr-defined]
            "schedulers": [config.scheduler.state_dict() for config in schedulers],
            "position": self._heal_position,
        }

    def _heal(self, payload: dict[str, Any]) -> None:
        """Apply a live peer's payload; while joining, also its training position (the loop continues at the
        peer's next batch, its sampler after the samples the job consumed, its RNG where the peer's was)."""
        started = time.time()
        apply_model_state(self.lightning_module, payload["model"])  # type: ignore[attr-defined]
        apply_optimizer_state(self.optimizers[0], payload["optimizer"])  # type: ignore[attr-defined]
        position = payload["position"]
        trainer = attached_trainer(self.lightning_module)  # type: ignore[attr-defined]
        schedulers = trainer.lr_scheduler_configs if trainer is not None else []
        if len(schedulers) != len(payload["schedulers"]):
            raise RuntimeError(
                f"The healing peer has {len(payload['schedulers'])} learning-rate schedulers, this group"
                f" {len(schedulers)}: every replica group must run the same `configure_optimizers`."
            )
        for config, state in zip(schedulers, payload["schedulers"]):
            config.scheduler.load_state_dict(state)
        batch_idx = position["batch_idx"] if position is not None else None
        if position is not None and trainer is not None:
            if self._joining:
                self._joined_at_batch = batch_idx
                trainer.fit_loop.load_state_dict(position["fit_loop"])
                self.checkpoints.resume.pending.update(position["record"])  # type: ignore[attr-defined]
                self._rng_after_heal = position["rng"]
            elif batch_idx != trainer.fit_loop.epoch_loop.batch_idx:
                rank_zero_warn(
                    f"Healed mid-run from a group at batch {batch_idx} while this group is at batch"
                    f" {trainer.fit_loop.epoch_loop.batch_idx}: the weights are the peer's, the data position is kept."
                )
        assert self.replica_groups is not None
        step = self.replica_groups.manager.current_step()
        self.replica_groups.heals.append(HealRecord(step, batch_idx, payload_bytes(payload), started))

    # ------------------------------------------------------------------ steps
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        if self._rng_after_heal is not None:  # after the loader's iterator drew its seed, as the peer's had
            restore_rng_state(self._rng_after_heal)
            self._rng_after_heal = None
        trainer = attached_trainer(self.lightning_module)  # type: ignore[attr-defined]
        if trainer is None or self.replica_groups is None:
            return
        loop = trainer.fit_loop.state_dict()
        for tracker in ("current", "total"):  # Lightning counted this batch as fetched: as before it was
            loop[_BATCH_PROGRESS][tracker]["ready"] -= 1
        record = self.checkpoints.record(  # type: ignore[attr-defined]
            trainer,
            type(self).__name__,
            self.world_size,
            self.sampler_shards(),  # type: ignore[attr-defined]
        )
        self._heal_position = {
            "batch_idx": batch_idx,
            "fit_loop": loop,
            "record": {key: record[key] for key in ("epoch_batches", "data_position") if key in record},
            "rng": capture_rng_state(),
        }

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        groups = self.replica_groups
        if groups is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        groups.start_step()
        trainer = attached_trainer(self.lightning_module)  # type: ignore[attr-defined]
        batch_idx = trainer.fit_loop.epoch_loop.batch_idx if trainer is not None else -1
        module = self.lightning_module  # type: ignore[attr-defined]

        def closure_then_average() -> Any:
            output = closure()
            groups.average_gradients(module.parameters())
            return output

        gate = _CommitGate(optimizer, lambda: groups.commit(batch_idx))
        output = super().optimizer_step(gate, closure_then_average, model, **kwargs)  # type: ignore[misc]
        guard = self.nonfinite  # type: ignore[attr-defined]
        if guard is not None and guard.last_skipped:  # non-finite after the average: this group does not commit
            groups.vote_against(batch_idx, "the step's loss or gradients were non-finite (`on_nonfinite='skip'`)")
        return output

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Written by the first group of the current quorum only: a dead group never blocks a save, and the groups
        (which hold the same weights) never write the same files twice."""
        groups = self.replica_groups
        if groups is None or groups.closed or groups.writes_checkpoints():
            super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]
            if groups is not None:
                groups.saved.append(checkpoint.get("global_step", -1))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Refused after this group joined a running job by healing: the checkpoint is older than the state it
        healed, and loading it would put this group out of step with the others (a relaunched group needs none)."""
        if self._joined_at_batch is not None:
            raise RuntimeError(
                f"This replica group healed from a live group and joined training at batch {self._joined_at_batch};"
                f" `fit(ckpt_path={checkpoint_path!r})` would load an older state over it. Relaunch a failed group"
                " without `ckpt_path`: only a restart of every group resumes from a checkpoint."
            )
        return super().load_checkpoint(checkpoint_path, weights_only)  # type: ignore[misc]

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        groups = self.replica_groups
        if groups is None or groups.closed or groups.writes_checkpoints():
            super().remove_checkpoint(filepath)  # type: ignore[misc]

    @override
    def teardown(self) -> None:
        if self.replica_groups is not None:
            self.replica_groups.shutdown()  # kept: its `history` and `heals` say what happened
        super().teardown()  # type: ignore[misc]


#: The composed class of each strategy class, made once: given `fault_tolerance` twice, a strategy is the same class.
_COMPOSED: dict[type, type] = {}


def with_fault_tolerance(
    strategy: StrategyClass, registered_name: str | None = None, description: str = "", module: str | None = None
) -> StrategyClass:
    """`strategy` with `FaultTolerantHooks` in front: the class a strategy given `fault_tolerance=FaultTolerance(...)`
    becomes (`compose_fault_tolerance`), one per strategy class whatever its layout (`dpar_auto` included).

    `registered_name` and `description` name it in Lightning's registry (`dpar_ft_hsdp`: the first call for a
    strategy class decides), and `module` is where it can be imported from (`lightning_dpar`), so a LightningCLI
    config and pickle find it by name. A class that has the hooks already is returned as it is."""
    if issubclass(strategy, FaultTolerantHooks):
        return strategy
    composed = _COMPOSED.get(strategy)
    if composed is None:
        name = f"FaultTolerant{strategy.__name__}"
        attributes: dict[str, Any] = {
            "__doc__": f"`{strategy.__name__}` whose launch is one torchft replica group; the groups replicate."
            " Args: `fault_tolerance` (`FaultTolerance`; default: all from the environment), then those of"
            f" `{strategy.__name__}`.",
            "__module__": module or __name__,
            "__qualname__": name,
        }
        if registered_name is not None:
            attributes |= {"strategy_name": registered_name, "strategy_description": description}
        composed = _COMPOSED[strategy] = type(name, (FaultTolerantHooks, strategy), attributes)
    return composed  # type: ignore[return-value]


def compose_fault_tolerance(strategy: object, fault_tolerance: FaultTolerance) -> None:
    """Make `strategy` (built without the hooks) fault-tolerant: its class becomes its class composed with the hooks
    (`with_fault_tolerance`, the same object layout plus methods), and the hooks' state is set. What a strategy's
    `fault_tolerance` argument does (`DparStrategy.__init__`), so no strategy needs a subclass of its own."""
    strategy.__class__ = with_fault_tolerance(type(strategy))
    FaultTolerantHooks._start_fault_tolerance(strategy, fault_tolerance)  # type: ignore[arg-type]
