"""The Lightning conformance matrix's shared harness: strategy columns, the Lightning-DDP reference runs, the
fingerprint compared between them, and how a test reports its cell (parity, refused) to `benchmarks/conformance.py`.

A row of the matrix is a feature (a Trainer flag, a callback); a column is a strategy (`STRATEGY_IDS`). A feature is
a function `feature(strategy, column) -> value` run on every rank of a worker launch: it builds a Trainer with
`strategy` (a fresh strategy object: ours for a column, Lightning's `DDPStrategy` for a reference), trains, and
returns, on rank 0, a JSON value, usually `fingerprint(trainer, ...)`. A refusal is the feature raising on every rank.
Each worker module uses its own prefix: worker group names are global (`tests/workers/run.py`).

Worker side (`tests/workers/<module>.py`)::

    FEATURES = {"buffers": buffers_feature, ...}
    GROUPS = column_groups("conformance", FEATURES)  # groups "conformance_<column>" and "conformance_ddp<N>"

Test side (`tests/test_<module>.py`)::

    @pytest.fixture(scope="session")
    def conformance(request, tmp_path_factory):
        return ConformanceLaunches("conformance", __name__, request, tmp_path_factory)

    @pytest.mark.conformance("buffers")
    @pytest.mark.parametrize("strategy", STRATEGY_IDS)
    def test_buffers(conformance, strategy, request):
        cell = conformance.cell("buffers", strategy)
        expect_parity(request, cell)                     # or expect_refused(request, cell, match="...")

Cost: the launches are planned once per session from the selected tests (`-m`, `-k`): one launch per world size
(2 ranks: `dpar_replicate`, `dpar_fsdp`, `pipeline` and the 2-rank DDP reference; 4 ranks: `dpar_hsdp`, `dpar_2d`,
the 4-rank reference; 1 rank: the pipeline column's reference), each running only the selected features' cases.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "COLUMNS",
    "FEATURES_ENV",
    "STRATEGY_IDS",
    "Cell",
    "Column",
    "ConformanceLaunches",
    "checkpoint_model_state",
    "column_groups",
    "compare",
    "conformance_module",
    "conformance_trainer",
    "expect_parity",
    "expect_refused",
    "fingerprint",
    "make_strategy",
]

#: The matrix's columns, in table order (also the `strategy` parameter ids of every conformance test).
STRATEGY_IDS = ("dpar_replicate", "dpar_fsdp", "dpar_hsdp", "dpar_2d", "pipeline")
#: Comma-separated feature names a launch runs (unset: all); set by `ConformanceLaunches` from the selected tests.
FEATURES_ENV = "DPAR_CONFORMANCE_FEATURES"


@dataclass(frozen=True)
class Column:
    """A strategy column (or a reference run): its world size, its data-parallel size (ranks seeing different
    batches), and the reference column it is compared with: Lightning's DDP on `data_parallel` ranks, so that every
    DDP rank sees the batches of one data-parallel rank of the column."""

    id: str
    world_size: int
    data_parallel: int
    reference: str

    @property
    def is_reference(self) -> bool:
        return self.id.startswith("ddp")

    @property
    def pipeline(self) -> bool:
        return self.id == "pipeline"

    @property
    def tensor_parallel(self) -> int:
        return 2 if self.id == "dpar_2d" else 1


COLUMNS: dict[str, Column] = {
    "dpar_replicate": Column("dpar_replicate", 2, 2, "ddp2"),
    "dpar_fsdp": Column("dpar_fsdp", 2, 2, "ddp2"),
    "dpar_hsdp": Column("dpar_hsdp", 4, 4, "ddp4"),  # replicate 2 x shard 2
    "dpar_2d": Column("dpar_2d", 4, 2, "ddp2"),  # data parallel 2 x tensor parallel 2
    "pipeline": Column("pipeline", 2, 1, "ddp1"),  # 2 stages, one data-parallel rank
    "ddp1": Column("ddp1", 1, 1, "ddp1"),
    "ddp2": Column("ddp2", 2, 2, "ddp2"),
    "ddp4": Column("ddp4", 4, 4, "ddp4"),
}


def make_strategy(column_id: str) -> Any:
    """A fresh strategy for a column, on its world size (inside a worker). Models give their tensor-parallel plan as
    a `tp_plan` attribute (as `ConformanceModule` does) for `dpar_2d`."""
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, ReplicateStrategy

    factories: dict[str, Callable[[], Any]] = {
        "dpar_replicate": ReplicateStrategy,
        "dpar_fsdp": FullyShardStrategy,
        "dpar_hsdp": lambda: FullyShardStrategy(replicate_size=2),
        "dpar_2d": lambda: FSDPTensorParallelStrategy(tensor_parallel_size=2),
        "pipeline": lambda: FullyShardStrategy(pipeline_parallel_size=2),
    }
    if COLUMNS[column_id].is_reference:
        return DDPStrategy(process_group_backend="gloo" if _accelerator() == "cpu" else None)
    return factories[column_id]()


def _accelerator() -> str:
    return os.environ.get("DPAR_TEST_ACCELERATOR", "cpu")


# ---------------------------------------------------------------------------------------------------- worker side
Feature = Callable[[Any, Column], Any]
#: Rows per rank's batch, and optimizer steps, of the default conformance run.
BATCH, STEPS = 4, 4


def conformance_module(column: Column, batchnorm: bool | None = None, **kwargs: Any) -> Any:
    """The matrix's model (`tests.support.models.ConformanceModule`: `Linear -> BatchNorm1d -> 2 residual blocks ->
    Linear`, a `tp_plan` for `dpar_2d`, logs `train_loss`/`val_loss` with `sync_dist`). The BatchNorm is left out
    (`batchnorm=None`) in the pipeline column and its reference, where it is refused (microbatches would change its
    statistics); pass `batchnorm=True` to test that refusal."""
    from tests.support.models import ConformanceModule

    if batchnorm is None:
        batchnorm = column.id not in ("pipeline", "ddp1")
    return ConformanceModule(batchnorm=batchnorm, **kwargs)


def conformance_trainer(strategy: Any, column: Column, **kwargs: Any) -> Any:
    """A quiet Trainer (`tests.workers.common.trainer_for`) on the column's ranks, `STEPS` steps by default."""
    from tests.workers.common import trainer_for

    kwargs.setdefault("max_steps", STEPS)
    kwargs.setdefault("devices", column.world_size)
    return trainer_for(strategy, **kwargs)


def column_groups(prefix: str, features: Mapping[str, Feature]) -> dict[str, Callable[[], Any]]:
    """Worker groups `<prefix>_<column id>` (one per column and reference), each a case per selected feature, named
    `case_name(prefix, feature, column)`."""
    from tests.workers.cases import Case

    def group(column: Column) -> Callable[[], Any]:
        def cases():
            selected = [f for f in os.environ.get(FEATURES_ENV, "").split(",") if f]
            for name, feature in features.items():
                if not selected or name in selected:
                    yield Case(
                        case_name(prefix, name, column.id), lambda f=feature: f(make_strategy(column.id), column)
                    )

        return cases

    return {f"{prefix}_{column.id}": group(column) for column in COLUMNS.values()}


def case_name(prefix: str, feature: str, column_id: str) -> str:
    return f"{prefix}:{feature}:{column_id}"


def fingerprint(trainer: Any, **extra: Any) -> Any:
    """What must agree with Lightning's DDP after a run: the full (unsharded) parameters and buffers as rank 0 holds
    them (`state`), each data-parallel rank's own buffers (`rank_buffers`, by data-parallel rank: DDP's ranks differ
    by their last step's update), and the logged values. A collective: call it on every rank. `extra` (JSON values,
    or tensors) is added as is. Returns the fingerprint on rank 0, None elsewhere."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from tests.workers.common import full_params

    state = full_params(trainer)
    module = trainer.lightning_module
    local = {n: b.detach().cpu() for n, b in module.named_buffers() if not isinstance(b, DTensor)}
    dp_rank = trainer.strategy.distributed_sampler_kwargs["rank"] if trainer.world_size > 1 else 0
    gathered = [None] * trainer.world_size
    if dist.is_initialized():
        dist.all_gather_object(gathered, (dp_rank, local))
    else:
        gathered = [(dp_rank, local)]
    if trainer.global_rank != 0:
        return None
    rank_buffers: dict[str, dict[str, Any]] = {}
    for rank, buffers in gathered:  # tensor-parallel peers hold the same; pipeline stages hold parts
        rank_buffers.setdefault(str(rank), {}).update({k: _json(v) for k, v in buffers.items()})
    logged = {k: _json(v) for k, v in trainer.logged_metrics.items()}
    return {
        "state": {k: _json(v) for k, v in state.items()},
        "rank_buffers": rank_buffers,
        "logged": logged,
        **{k: _json_tree(v) for k, v in extra.items()},
    }


def checkpoint_model_state(path: Any) -> dict[str, Any]:
    """A saved checkpoint's model tensors in full, by name: a sharded directory (read offline, in this process) or
    Lightning's one file."""
    from pathlib import Path

    import torch

    from lightning_dpar.checkpoint.offline_reader import OfflineCheckpoint

    if Path(path).is_dir():
        return dict(OfflineCheckpoint(str(path)).iter_model())
    return dict(torch.load(path, map_location="cpu", weights_only=False)["state_dict"])


def _json_tree(value: Any) -> Any:
    """`value` with its tensors (also inside dicts and lists) as numbers and lists."""
    if isinstance(value, dict):
        return {str(k): _json_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_tree(v) for v in value]
    return _json(value)


def _json(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return value.tolist() if value.dim() else value.item()
    return value


# ---------------------------------------------------------------------------------------------------- comparing
def compare(got: Any, want: Any, atol: float = 1e-5, path: str = "") -> list[str]:
    """The differences between two fingerprints (nested dicts/lists of numbers): missing or extra keys, lengths,
    and numbers further apart than `atol`. Empty when they agree."""
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return [f"{path}: got {type(got).__name__}, want a dict"]
        problems = [f"{path}.{k}: missing" for k in want if k not in got]
        problems += [f"{path}.{k}: not in the reference" for k in got if k not in want]
        for key in want:
            if key in got:
                problems += compare(got[key], want[key], atol, f"{path}.{key}")
        return problems
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return [f"{path}: got {_short(got)}, want {_short(want)}"]
        problems = []
        for i, (g, w) in enumerate(zip(got, want)):
            problems += compare(g, w, atol, f"{path}[{i}]")
            if len(problems) > 20:
                break
        return problems
    if isinstance(want, (int, float)) and isinstance(got, (int, float)) and not isinstance(want, bool):
        if math.isclose(got, want, rel_tol=0, abs_tol=atol) or (math.isnan(got) and math.isnan(want)):
            return []
        return [f"{path}: got {got!r}, want {want!r} (difference {abs(got - want):.3g} > atol {atol})"]
    return [] if got == want else [f"{path}: got {_short(got)}, want {_short(want)}"]


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) < 120 else text[:117] + "..."


# ---------------------------------------------------------------------------------------------------- test side
@dataclass
class Cell:
    """One cell's runs: the strategy column's case and its DDP reference's case (`value` on rank 0, or `errors` by
    rank when the case raised)."""

    feature: str
    column: Column
    value: Any
    errors: dict[int, str]
    reference_value: Any
    reference_errors: dict[int, str]


class ConformanceLaunches:
    """Runs a test module's conformance cases: the launches are planned once, from the session's selected tests
    that carry `conformance(feature)` and a `strategy` parameter, for the worker groups named `<prefix>_<column>`."""

    def __init__(self, prefix: str, module: str, request: Any, tmp_path_factory: Any, timeout: int = 600) -> None:
        self.prefix, self.timeout = prefix, timeout
        self._tmp = tmp_path_factory
        self._results: Any = None
        self._selected = self._plan(request.session.items, module)

    @staticmethod
    def _plan(items: list[Any], module: str) -> tuple[set[str], set[str]]:
        """The features and columns of the selected tests of test module `module` (its `__name__`)."""
        features, columns = set(), set()
        for item in items:
            marker = item.get_closest_marker("conformance")
            callspec = getattr(item, "callspec", None)
            if marker is None or callspec is None or "strategy" not in callspec.params:
                continue
            if getattr(getattr(item, "module", None), "__name__", None) != module:
                continue
            features.add(marker.args[0])
            columns.add(callspec.params["strategy"])
        return features, columns

    def results(self) -> Any:
        from tests.conftest import LaunchResults, run_workers

        if self._results is None:
            features, columns = self._selected
            wanted = columns | {COLUMNS[c].reference for c in columns}
            results = LaunchResults()
            for world in sorted({COLUMNS[c].world_size for c in wanted}):
                groups = ",".join(f"{self.prefix}_{c}" for c in sorted(wanted) if COLUMNS[c].world_size == world)
                env = {FEATURES_ENV: ",".join(sorted(features))}
                tmp = self._tmp.mktemp(f"{self.prefix}-w{world}")
                results.merge(run_workers(world, groups, tmp, timeout=self.timeout, extra_env=env))
            self._results = results
        return self._results

    def cell(self, feature: str, column_id: str) -> Cell:
        """The column's and its reference's outcome for `feature` (a missing case fails the test with the log)."""
        results = self.results()
        column = COLUMNS[column_id]
        got = self._record(results, feature, column_id)
        want = self._record(results, feature, column.reference)
        return Cell(feature, column, got.value, got.errors, want.value, want.errors)

    def _record(self, results: Any, feature: str, column_id: str) -> Any:
        name = case_name(self.prefix, feature, column_id)
        if name not in results:
            results[name]  # fails the test with the launch's log tail
        return results.records[name]


def _record_outcome(request: Any, outcome: str) -> None:
    """What `benchmarks/conformance.py` reads for the cell (a failed test is `failed` whatever was recorded)."""
    request.node.user_properties.append(("conformance_outcome", outcome))


def expect_parity(request: Any, cell: Cell, atol: float = 1e-5, keys: tuple[str, ...] | None = None) -> None:
    """Assert the column's run ended as Lightning's DDP's did (both ran without error; fingerprints agree within
    `atol`; only `keys` of the fingerprints if given), and record the cell as `parity`."""
    import pytest

    for who, errors in (("reference (Lightning DDP)", cell.reference_errors), (cell.column.id, cell.errors)):
        if errors:
            details = "\n".join(f"--- rank {rank} ---\n{error}" for rank, error in sorted(errors.items()))
            pytest.fail(f"{cell.feature}: the {who} run raised on ranks {sorted(errors)}:\n{details}")
    got, want = cell.value, cell.reference_value
    if keys is not None:
        got, want = {k: got[k] for k in keys}, {k: want[k] for k in keys}
    problems = compare(got, want, atol)
    assert not problems, f"{cell.feature} under {cell.column.id} differs from Lightning's DDP:\n" + "\n".join(
        problems[:30]
    )
    _record_outcome(request, "parity")


def expect_refused(request: Any, cell: Cell, match: str, error_type: str = "") -> str:
    """Assert the column refused the feature on every rank with an error matching `match` (a regex searched in the
    traceback text; `error_type`, e.g. "ValueError", checked too if given), and record the cell as `refused`.
    Returns rank 0's traceback."""
    import re

    import pytest

    if not cell.errors:
        pytest.fail(f"{cell.feature} under {cell.column.id}: expected a refusal matching {match!r}, but it ran")
    world = cell.column.world_size
    assert sorted(cell.errors) == list(range(world)), f"refused on ranks {sorted(cell.errors)} of {world} only"
    for rank, error in cell.errors.items():
        last = error.strip().splitlines()[-1] if error.strip() else ""
        assert re.search(match, error), f"rank {rank} raised something else:\n{error}"
        if error_type:
            assert error_type in last or f"{error_type}:" in error, f"rank {rank}: not a {error_type}:\n{error}"
    _record_outcome(request, "refused")
    return cell.errors[0]
