"""Loss parallel (`loss_parallel=True`) cases for `tests/launched/test_loss_parallel.py`: the example GPT with an
uneven vocabulary (65 over TP 2) and its loss written as a user writes it (`F.cross_entropy` in `training_step` on
labels with `ignore_index` runs), and a transformers Llama on its own loss (`labels=`), trained through real Trainers
under TP 2 (2 ranks) and TP 2 x FSDP 2 (4 ranks), each against one process on the same global batches; one step's
activation memory with and without loss parallel beside the activation estimate of each; and each refusal, raised
alike on every rank before training, or at the first use of the sharded logits."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy
from lightning_dpar.examples.gpt import GPT, TP_PLAN
from tests.support.hf_configs import decoder_config
from tests.workers.cases import Case
from tests.workers.common import world_size
from tests.workers.context_parallel import SEQ, Tokens, expect_error, measure_and_estimate, parity

#: Not divisible by the tensor-parallel size: the head's shards are 33 and 32 rows.
UNEVEN_VOCAB = 65
#: The example GPT's plan with its head column-parallel and gathered: what loss parallel keeps sharded.
HEAD_PLAN = {**TP_PLAN, "model.head": "colwise_gather_output"}


class LabelledGPT(GPT):
    """The example GPT on `{"input_ids", "labels"}` batches, its loss the user's own `F.cross_entropy` over the
    flattened logits (`ignore_index` -100 by default), logged as Lightning users log it."""

    def __init__(self, vocab_size: int = UNEVEN_VOCAB, smoothing: float = 0.0, argmax: bool = False, **sizes: Any):
        torch.manual_seed(0)
        super().__init__(vocab_size=vocab_size, **{"block_size": SEQ, "n_layer": 2, "n_head": 4, "n_embd": 32, **sizes})
        self.tp_plan = dict(HEAD_PLAN)
        self.smoothing, self.argmax = smoothing, argmax

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self(batch["input_ids"][:, :-1])
        if self.argmax:
            logits.argmax(-1).eq(batch["labels"][:, 1:]).float().mean()  # an accuracy on the sharded logits
        labels = batch["labels"][:, 1:]
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), label_smoothing=self.smoothing)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, sync_dist=True)  # reduced over the data-parallel ranks: a DTensor in the step
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)


class UnevenLlama(L.LightningModule):
    """A transformers Llama with a vocabulary of 65 trained on its own loss (`labels=`, shifted inside the model,
    `ignore_index` -100)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        self.net = LlamaForCausalLM(decoder_config(vocab_size=UNEVEN_VOCAB, max_position_embeddings=4 * SEQ))
        # The model's own layer plan and its gathered `lm_head`; the embedding stays whole (a row-wise embedding
        # must divide its vocabulary; the output layer under loss parallel need not).
        self.tp_plan = {
            **{f"net.model.{key}": style for key, style in self.net.config.base_model_tp_plan.items()},
            "net.lm_head": "colwise_gather_output",
        }

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.net(**batch).loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class BigVocabGPT(GPT):
    """The example GPT as shipped (its own `F.cross_entropy` on token ids, AdamW with warm-up) with a vocabulary of
    16,384 and its head gathered in the plan: on 4 x 16 tokens per rank, 4 MiB of fp32 logits against 2 MiB of
    head weights, so the logits decide which layouts fit."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(vocab_size=16384, block_size=SEQ, n_layer=2, n_head=4, n_embd=32)
        self.tp_plan = dict(HEAD_PLAN)

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        return self._loss(batch)


def auto_loss_parallel() -> dict | None:
    """`dpar_auto` with loss parallel allowed, at 60 MiB per rank: only TP 2 with loss parallel (57.4 MiB by the
    cost model) and pipelines fit, and TP 2 is faster; the search chooses it, the strategy trains it with loss
    parallel (its plan's output layer) and equals one process."""
    from lightning_dpar import AutoParallelStrategy

    strategy = AutoParallelStrategy(loss_parallel=True, device_memory=60 / 1024)
    result = parity(strategy, BigVocabGPT, 1, Tokens(SEQ + 1))
    if result is None:
        return None
    assert strategy.chosen is not None and strategy.plan is not None
    return {**result, "chosen": strategy.chosen.describe(), "loss_parallel": strategy.plan.loss_parallel}


def tp(size: int = 2, **options: Any) -> Callable[[], Any]:
    return lambda: FSDPTensorParallelStrategy(tensor_parallel_size=size, loss_parallel=True, **options)


def group_loss_parallel() -> Iterator[Case]:
    world = world_size()
    dp = world // 2
    layout = "tp2" if world == 2 else "tp2_fsdp2"
    gpt_data = lambda: Tokens(SEQ + 1, ignored=True)  # noqa: E731
    yield Case(f"gpt_{layout}", lambda: parity(tp()(), LabelledGPT, dp, gpt_data()))
    yield Case(f"llama_{layout}", lambda: parity(tp()(), UnevenLlama, dp, Tokens(SEQ, ignored=True)))
    if world == 4:
        yield Case("error_pipeline", lambda: expect_error(tp(pipeline_parallel_size=2), LabelledGPT, gpt_data()))
    if world != 2:
        return
    yield Case("loss_parallel_validation_after_fit", validation_after_fit)
    yield Case("loss_parallel_auto_layout", auto_loss_parallel)
    # Refused before training, alike on every rank.
    yield Case(
        "error_without_tp",
        lambda: expect_error(lambda: FullyShardStrategy(loss_parallel=True), LabelledGPT, gpt_data()),
    )
    yield Case(
        "error_head_not_in_plan",
        lambda: expect_error(tp(tp_plan=TP_PLAN), LabelledGPT, gpt_data()),
    )
    yield Case(
        "error_head_rowwise",
        lambda: expect_error(tp(tp_plan={**TP_PLAN, "model.head": "rowwise"}), LabelledGPT, gpt_data()),
    )
    # At the first use of the sharded logits, alike on every rank.
    yield Case("error_label_smoothing", lambda: expect_error(tp(), lambda: LabelledGPT(smoothing=0.1), gpt_data()))
    yield Case("error_argmax", lambda: expect_error(tp(), lambda: LabelledGPT(argmax=True), gpt_data()))


def validation_after_fit() -> dict | None:
    """The GPT fitted under TP 2 with loss parallel, then `validate` (its `val_loss` logged with `sync_dist`): the
    validation forward runs inside `loss_parallel()` too, and the loss equals one process's on the same model."""
    from torch.utils.data import DataLoader

    from tests.workers.common import BATCH, full_params, trainer_for

    trainer = trainer_for(tp()())
    module = LabelledGPT()
    trainer.fit(module, DataLoader(Tokens(SEQ + 1, ignored=True), batch_size=BATCH))
    val_data = Tokens(SEQ + 1, n=8, seed=11, ignored=True)
    (metrics,) = trainer.validate(module, DataLoader(val_data, batch_size=BATCH), verbose=False)
    params = full_params(trainer)
    if trainer.global_rank != 0:
        return None
    reference = LabelledGPT()
    reference.load_state_dict(params)
    with torch.no_grad():
        batches = [
            {k: torch.stack([val_data[i][k] for i in range(s, s + BATCH)]) for k in ("input_ids", "labels")}
            for s in (0, BATCH)
        ]
        want = sum(float(reference.loss(b)) for b in batches) / 2
    return {"val_loss": float(metrics["val_loss"]), "want": want}


def logits_memory(loss_parallel: bool) -> dict | None:
    """One step's activation memory on each rank (`StorageMeter`, which follows storages as the estimate does) for
    the GPT with a vocabulary of 4,096 on 2 x 256 tokens under TP 2, with or without loss parallel, and
    the activation estimate (the `plan` dry run's) of the same layout and batch."""

    def make() -> LabelledGPT:
        return LabelledGPT(vocab_size=4096, block_size=256, n_embd=64)

    strategy = FSDPTensorParallelStrategy(tensor_parallel_size=2, loss_parallel=loss_parallel, tp_plan=HEAD_PLAN)
    batch = {"input_ids": torch.zeros(2, 257, dtype=torch.long), "labels": torch.zeros(2, 257, dtype=torch.long)}
    result = measure_and_estimate(strategy, make, Tokens(257, n=16, ignored=True), batch)
    if result is None:
        return None
    measured, estimate = result
    footprint = estimate.rank(0).per_microbatch(False)
    return {
        "retained": [r for r, _ in measured],
        "peak": [p for _, p in measured],
        "estimated": {"retained": footprint.retained, "peak": footprint.peak},
        "logits_bytes_whole": 2 * 256 * 4096 * 4,
    }


def group_loss_parallel_memory() -> Iterator[Case]:
    for enabled in (False, True):
        yield Case(f"memory_loss_parallel_{enabled}", lambda e=enabled: logits_memory(e))


GROUPS = {"loss_parallel": group_loss_parallel, "loss_parallel_memory": group_loss_parallel_memory}
