"""Where `AutoParallelStrategy` reads the batch it chooses the layout for: where Lightning reads the training data.

The layout is chosen in `setup_environment`, before the process group, the sampler and the loaders exist, and the
per-rank batch may depend on the choice: a module whose `train_dataloader()` sizes its loader from
`trainer.distributed_sampler_kwargs["num_replicas"]` (the data-parallel size) yields a larger batch per rank on a
layout with fewer data-parallel ranks. So the data is read at every data-parallel size the search considers:

- a `DataLoader` given to `fit`: its `batch_size`, the same at every size;
- a data module with an int `batch_size` attribute: that, the same at every size;
- otherwise the `train_dataloader()` hook of the data module, or of the LightningModule (Lightning's default
  source): called once per data-parallel size `d` with `trainer.distributed_sampler_kwargs` answering
  `{"num_replicas": d, "rank": 0}` (`loader_at`), and its loader's `batch_size` read. Only the loader is built
  (a `DataLoader` starts no worker before it is iterated); Lightning calls the hook again once the layout is chosen,
  with the chosen size. The hook runs before `setup()`: one that needs what `setup()` builds raises, and then the
  strategy asks for `global_batch_size=` or `batch_size=` instead of guessing.

`resolve_batch_rule` turns that and the strategy's own `batch_size` / `global_batch_size` into a `BatchRule`;
`check_no_size_fits` refuses, before the search and any collective, a rule no data-parallel size can train.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import DataLoader

from lightning_dpar.helpers import divisors
from lightning_dpar.layout_search.batch import BatchRule

__all__ = ["FIX", "check_count", "check_loader", "check_no_size_fits", "read_batch_sizes", "resolve_batch_rule"]

#: What to set, named in every refusal about the batch.
FIX = (
    "Pass `global_batch_size=` (samples per optimizer step over all data-parallel ranks; each rank's loader must then"
    " yield global / `trainer.distributed_sampler_kwargs['num_replicas']`) or `batch_size=` (samples per"
    " data-parallel rank per step) to AutoParallelStrategy (`--trainer.strategy.global_batch_size=` with"
    " LightningCLI)."
)


def check_count(name: str, value: Any) -> None:
    """Refuse a batch argument that is not a positive number of samples."""
    if value is not None and not _positive(value):
        raise ValueError(f"`{name}={value!r}` is invalid: give a positive number of samples.")


def read_batch_sizes(
    source: Any, world_size: int, loader_at: Callable[[Any, int], Any]
) -> tuple[dict[int, int] | None, str]:
    """The per-rank batch `source` (what `fit` trains on) yields at each data-parallel size of `world_size` ranks,
    and what the source is; or `None` and why it cannot be read. `loader_at(source, d)` calls its
    `train_dataloader()` as seen from `d` data-parallel ranks."""
    sizes = divisors(world_size)
    if isinstance(source, DataLoader):
        name = "the training DataLoader"
        if _positive(source.batch_size):
            return dict.fromkeys(sizes, source.batch_size), f"{name} (batch_size={source.batch_size})"
        return None, f"{name} has no `batch_size` (it batches with a `batch_sampler` or not at all)"
    attribute = getattr(source, "batch_size", None) if isinstance(source, L.LightningDataModule) else None
    if _positive(attribute):
        return dict.fromkeys(sizes, attribute), f"the data module's batch_size ({attribute})"
    if not isinstance(source, (L.LightningModule, L.LightningDataModule)):
        return None, f"the training data is a {type(source).__name__}, not a DataLoader, data module or module"
    name = f"{type(source).__name__}.train_dataloader()"
    if not is_overridden("train_dataloader", source):
        return None, f"{name} is not defined, and `fit` was given no training data"
    read: dict[int, int] = {}
    for d in sizes:
        try:
            loader = loader_at(source, d)
        except Exception as err:  # the user's hook, run before `setup()`: anything it raises is the answer
            return None, (
                f"{name}, called before the process group exists (with `trainer.distributed_sampler_kwargs` ="
                f" {{'num_replicas': {d}, 'rank': 0}}) to read the per-rank batch, raised {type(err).__name__}:"
                f" {err}"
            )
        batch = getattr(loader, "batch_size", None)
        if not _positive(batch):
            return None, f"{name} returned a {type(loader).__name__} without a `batch_size`"
        read[d] = batch
    return read, name


def resolve_batch_rule(
    batch_size: int | None, global_batch_size: int | None, read: tuple[dict[int, int] | None, str] | None
) -> BatchRule:
    """The rule the search prices: the strategy's `batch_size`, else its `global_batch_size` (checked against what
    the data was read to yield, where it could be read), else what the data yields (`read`; refused, naming what
    to set, where it could not be read)."""
    if batch_size is not None:
        return BatchRule(per_rank=batch_size)
    sizes, source = read if read is not None else (None, "the training data")
    if global_batch_size is not None:
        return BatchRule(global_batch=global_batch_size, observed=tuple(sorted((sizes or {}).items())), source=source)
    if sizes is None:
        raise ValueError(f"AutoParallelStrategy cannot read the per-rank batch size: {source}. {FIX}")
    return BatchRule.observe(sizes, source)


def check_no_size_fits(rule: BatchRule, world_size: int) -> None:
    """Refuse a rule that gives no data-parallel size of `world_size` ranks a batch, naming the values that would."""
    sizes = rule.sizes(world_size)
    if any(isinstance(b, int) for b in sizes.values()):
        return
    reasons = "; ".join(f"{d} data-parallel ranks: {why}" for d, why in sizes.items())
    what = f"`global_batch_size={rule.global_batch}`" if rule.global_batch is not None else "The batch"
    fixed = {b for _, b in rule.observed}
    if rule.global_batch is not None and len(fixed) == 1:
        per_rank = fixed.pop()
        valid = ", ".join(f"`global_batch_size={per_rank * d}`" for d in divisors(world_size))
        hint = (
            f" With {rule.source}, the global batch must be a multiple of {per_rank} ({per_rank} x a data-parallel"
            f" size of {world_size} ranks): {valid}; or size the loader from `trainer.distributed_sampler_kwargs`."
        )
    else:
        hint = f" {FIX}"
    raise ValueError(f"{what} cannot be trained on {world_size} ranks ({reasons}).{hint}")


def check_loader(loader: Any, expected: int | str, data_parallel: int, rule: BatchRule) -> None:
    """Refuse a training loader whose batch is not the one the layout was chosen for (a `train_dataloader()` that
    built something else once the layout was chosen, or a loader the strategy could not read and was told the
    size of)."""
    batch = getattr(loader, "batch_size", None)
    if not _positive(batch) or batch == expected:
        return
    fix = FIX[0].lower() + FIX[1:]
    raise ValueError(
        f"The training loader yields batches of {batch} per rank, but the layout was chosen for {expected} at"
        f" {data_parallel} data-parallel ranks ({rule.describe()}). Make the loader yield {expected}, or {fix}"
    )


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
