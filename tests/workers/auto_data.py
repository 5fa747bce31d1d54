"""`dpar_auto` reads the batch where Lightning reads the training data, through real Trainers (issue 32, item 3):

- the most common LightningModule, whose own `train_dataloader()` sizes the per-rank batch as a global batch over
  `trainer.distributed_sampler_kwargs["num_replicas"]`, with `strategy="dpar_auto"` and nothing else;
- the same from a data module's `train_dataloader()`;
- `global_batch_size=` with a `DataLoader` of a fixed per-rank batch passed to `fit` (the data-parallel size must
  then be global / per-rank);
- and the refusal, on every rank before any collective, of a global batch the loader cannot make.

Each run is compared with one process training the same global batches (`TinyGPT`, SGD, fp32)."""

from __future__ import annotations

from collections.abc import Iterator

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_dpar import AutoParallelStrategy
from lightning_dpar.examples.gpt import GPT
from tests.workers.cases import Case
from tests.workers.common import full_params, trainer_for
from tests.workers.hf_models import SEQ, VOCAB, TokenIds

#: Sequences per optimizer step over all data-parallel ranks.
GLOBAL = 8


class TinyGPT(GPT):
    """The example GPT, 4 layers of width 32; SGD, so that the comparison measures gradients."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=4, n_embd=32)

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def sized_loader(trainer: L.Trainer, global_batch: int = GLOBAL) -> DataLoader:
    """What the Lightning docs' modules write: each rank's share of a global batch, sized from the sampler's
    replicas (the data-parallel size)."""
    replicas = trainer.distributed_sampler_kwargs["num_replicas"]
    return DataLoader(TokenIds(), batch_size=global_batch // replicas)


class Recording(TinyGPT):
    """Records the batch each rank trains on at each step. With 1 layer nothing pipelines, and the search chooses
    data-parallel layouts (each rank a share of the global batch); with 4 it chooses pipelines of 1 data-parallel
    rank."""

    def __init__(self, n_layer: int = 4) -> None:
        torch.manual_seed(0)
        GPT.__init__(self, vocab_size=VOCAB, block_size=SEQ, n_layer=n_layer, n_head=4, n_embd=32)
        self.batch_sizes: list[int] = []

    def on_train_batch_start(self, batch, batch_idx):
        self.batch_sizes.append(len(batch))


class OwnLoaderGPT(Recording):
    """Owns its training data: `train_dataloader()` returns the loader, sized from the sampler's replicas."""

    def train_dataloader(self):
        return sized_loader(self.trainer)


class SetupLoaderGPT(OwnLoaderGPT):
    """Builds its data in `setup`, which Lightning calls after the layout is chosen: its loader cannot be read then."""

    def setup(self, stage):
        self.data = TokenIds()

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=GLOBAL // self.trainer.distributed_sampler_kwargs["num_replicas"])


class SizedData(L.LightningDataModule):
    """A data module without a `batch_size` attribute, its loader sized like `OwnLoaderGPT`'s."""

    def train_dataloader(self):
        return sized_loader(self.trainer)


def _reference(global_batch: int, steps: int, n_layer: int) -> dict[str, torch.Tensor]:
    """One process on the global batches the ranks train on together: whatever the data-parallel size `d`, rank `r`
    takes the sampler's positions `r, r + d, ...`, so step `s` covers positions `s * G` to `(s + 1) * G - 1`."""
    module = Recording(n_layer)
    optimizer = module.configure_optimizers()
    data = TokenIds()
    order = list(DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0))
    for step in range(steps):
        optimizer.zero_grad()
        batch = torch.stack([data[i] for i in order[step * global_batch : (step + 1) * global_batch]])
        module.training_step(batch, 0).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def parity(strategy, module: Recording, fit_kwargs: dict, global_batch: int = GLOBAL) -> dict | None:
    """Train `module` with `strategy`; on rank 0 the chosen layout, the batches trained on and the largest difference
    to one process on the same global batches."""
    trainer = trainer_for(strategy)
    trainer.fit(module, **fit_kwargs)
    got = full_params(trainer)
    auto = trainer.strategy
    assert isinstance(auto, AutoParallelStrategy) and auto.chosen is not None
    data_parallel = auto.chosen.dims.data_parallel
    if trainer.global_rank != 0:
        return None
    want = _reference(global_batch, trainer.global_step, module.hparams.n_layer)
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    return {
        "chosen": auto.chosen.describe(),
        "data_parallel": data_parallel,
        "sampler_replicas": trainer.distributed_sampler_kwargs["num_replicas"],
        "batch_sizes": module.batch_sizes,
        "steps": trainer.global_step,
        "vs_single": max((got[k] - want[k]).abs().max().item() for k in want),
    }


def refused(strategy, module: L.LightningModule, fit_kwargs: dict, match: str) -> str:
    """The error every rank raises, before any collective (no rank waits for another)."""
    with pytest.raises(ValueError, match=match) as caught:
        trainer_for(strategy).fit(module, **fit_kwargs)
    return str(caught.value)


def group_auto_data() -> Iterator[Case]:
    yield Case("module_loader", lambda: parity("dpar_auto", OwnLoaderGPT(), {}))
    yield Case("datamodule_loader", lambda: parity("dpar_auto", Recording(n_layer=1), {"datamodule": SizedData()}))
    yield Case(
        "global_with_loader",
        lambda: parity(
            AutoParallelStrategy(global_batch_size=GLOBAL),
            Recording(),
            {"train_dataloaders": DataLoader(TokenIds(), batch_size=GLOBAL // 2)},
        ),
    )
    yield Case(
        "global_loader_mismatch",
        lambda: refused(
            AutoParallelStrategy(global_batch_size=6),
            Recording(),
            {"train_dataloaders": DataLoader(TokenIds(), batch_size=4)},
            match=r"global_batch_size=6",
        ),
    )
    yield Case(
        "loader_needs_setup",
        lambda: refused("dpar_auto", SetupLoaderGPT(), {}, match=r"Pass `global_batch_size=`"),
    )


GROUPS = {"auto_data": group_auto_data}
