"""Context-parallel cases for `tests/launched/test_context_parallel.py`: the example GPT and transformers decoders
trained through real Trainers with each sequence split between gloo ranks (CP alone, CP x FSDP, CP x TP), each
against single-process training on the same global batches; the loss each rank logs; `ignore_index` tokens spread
unevenly between the ranks' parts; and each refusal."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy
from lightning_dpar.examples.gpt import GPT
from tests.support.hf_configs import decoder_config
from tests.workers.cases import Case
from tests.workers.common import BATCH, STEPS, full_params, trainer_for, world_size

VOCAB, SEQ = 64, 16


class Tokens(Dataset):
    """`n` random sequences of `length` token ids below `VOCAB`; with `ignored`, labels with `-100` on a run of
    positions that differs per sequence (so the context-parallel ranks' parts hold different numbers of them)."""

    def __init__(self, length: int, n: int = 64, seed: int = 3, ignored: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, length), generator=g)
        self.ignored = ignored

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Any:
        if not self.ignored:
            return self.ids[i]
        labels = self.ids[i].clone()
        start = (3 * i) % (len(labels) // 2)
        labels[start : start + len(labels) // 2 + i % 3] = -100  # mostly in the head's chunks
        return {"input_ids": self.ids[i], "labels": labels}


class HFModule(L.LightningModule):
    """A transformers causal LM trained on its own loss (`labels=`, which shifts them inside the model)."""

    def __init__(self, config_class: str = "LlamaConfig", attn: str | None = None, **settings: Any) -> None:
        super().__init__()
        import transformers

        torch.manual_seed(0)
        config = decoder_config(config_class, vocab_size=VOCAB, max_position_embeddings=4 * SEQ, **settings)
        if attn is not None:
            config._attn_implementation = attn
        name = config_class.replace("Config", "ForCausalLM")
        self.net = getattr(transformers, name)(config)

    def loss(self, batch: Any) -> torch.Tensor:
        if isinstance(batch, dict):
            return self.net(**batch).loss
        return self.net(input_ids=batch, labels=batch).loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class GPTModule(GPT):
    """The example GPT (AdamW with warm-up), as shipped; `loss` for the reference loop."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32)

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        return self._loss(batch)


class LossLog(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"].detach()))


def rank_batches(data: Dataset, dp: int, steps: int = STEPS) -> list[list[Any]]:
    """Per step, each data-parallel rank's batch as Lightning's distributed sampler feeds it."""
    from torch.utils.data import default_collate

    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))  # Lightning shuffles a training loader's shard with it
    samplers = [DistributedSampler(data, num_replicas=dp, rank=r, shuffle=True, seed=seed) for r in range(dp)]
    per_rank = [list(sampler) for sampler in samplers]
    return [
        [default_collate([data[i] for i in per_rank[r][s * BATCH : (s + 1) * BATCH]]) for r in range(dp)]
        for s in range(steps)
    ]


def reference(make: Callable[[], L.LightningModule], data: Dataset, dp: int) -> tuple[dict, list[list[float]]]:
    """One process on the same global batches: the data-parallel ranks' losses averaged, as their gradients are;
    the parameters after the steps, and each step's loss of each data-parallel rank's batch."""
    module = make()
    configured = module.configure_optimizers()
    optimizer = configured["optimizer"] if isinstance(configured, dict) else configured
    scheduler = configured["lr_scheduler"]["scheduler"] if isinstance(configured, dict) else None
    losses = []
    for batches in rank_batches(data, dp):
        optimizer.zero_grad()
        rank_losses = [module.loss(b) for b in batches]
        (sum(rank_losses) / dp).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append([float(loss.detach()) for loss in rank_losses])
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, losses


def parity(strategy: Any, make: Callable[[], L.LightningModule], dp: int, data: Dataset) -> dict | None:
    """Train under `strategy`; on rank 0 the largest parameter difference to one process, and the logged losses."""
    log = LossLog()
    trainer = trainer_for(strategy, callbacks=[log])
    module = make()
    trainer.fit(module, DataLoader(data, batch_size=BATCH))
    got = full_params(trainer)
    runtime = trainer.strategy.applied.context_parallel
    sent = runtime.attention.counter.forward_bytes if runtime is not None else 0
    gathered: list[Any] = [None] * world_size()
    data_rank = trainer.strategy.distributed_sampler_kwargs["rank"]
    torch.distributed.all_gather_object(gathered, (data_rank, log.losses))
    if trainer.global_rank != 0:
        return None
    want, losses = reference(make, data, dp)
    assert set(got) == set(want), (sorted(got), sorted(want))
    return {
        "max_abs_diff": max((got[k] - want[k]).abs().max().item() for k in want),
        # every rank's loss against its data-parallel rank's whole-sequence loss in one process
        "loss_diff": max(abs(a - step[d]) for d, logged in gathered for a, step in zip(logged, losses)),
        "steps": [len(logged) for _, logged in gathered],
        "dims": trainer.strategy.dims.describe(),
        "kv_bytes_sent_rank0": sent,  # keys and values this rank sent in the forwards (0 if nothing was split)
        "attention_calls": runtime.attention.calls if runtime is not None else 0,  # recomputations included
    }


def validation_after_fit() -> dict | None:
    """The example GPT fitted with CP over every rank, then `validate` (its `val_loss` logged with `sync_dist`): the
    validation forward splits the sequence too, and the loss equals one process's on the trained model."""
    world = world_size()
    trainer = trainer_for(FullyShardStrategy(context_parallel_size=world))
    module = GPTModule()
    trainer.fit(module, DataLoader(gpt_data(), batch_size=BATCH))
    val_data = Tokens(SEQ + 1, n=8, seed=11)
    trainer.strategy.applied.context_parallel.attention.counter.reset()  # what validation alone sends
    (metrics,) = trainer.validate(module, DataLoader(val_data, batch_size=BATCH), verbose=False)
    sent = trainer.strategy.applied.context_parallel.attention.counter.forward_bytes
    if trainer.global_rank != 0:
        return None
    return {"val_loss": metrics["val_loss"], "want": reference_val_loss(val_data), "kv_bytes_sent_rank0": sent}


def reference_val_loss(val_data: Tokens) -> float:
    """The example GPT's loss on `val_data`'s two batches (averaged) after the launch's steps in one process."""
    reference = GPTModule()
    reference.load_state_dict(reference_params())
    with torch.no_grad():
        return sum(float(reference.loss(val_data.ids[i : i + BATCH])) for i in (0, BATCH)) / 2


def reference_params() -> dict[str, torch.Tensor]:
    """The example GPT after the steps of one process on the launch's global batches (CP over every rank: one)."""
    return reference(GPTModule, gpt_data(), 1)[0]


def gpt_data() -> Dataset:
    return Tokens(SEQ + 1)  # the GPT shifts inside its loss: SEQ inputs, SEQ targets


def hf_case(
    cp: int, config_class: str = "LlamaConfig", tp: int = 1, checkpointing: bool = False, **settings: Any
) -> Callable[[], Any]:
    dp = world_size() // (cp * tp)

    def run():
        options = {"context_parallel_size": cp, "activation_checkpointing": checkpointing}
        if tp > 1:
            strategy = FSDPTensorParallelStrategy(tensor_parallel_size=tp, tp_plan="auto", **options)
        else:
            strategy = FullyShardStrategy(**options)
        return parity(strategy, lambda: HFModule(config_class, **settings), dp, Tokens(SEQ))

    return run


def gpt_case(cp: int, tp: int = 1, **options: Any) -> Callable[[], Any]:
    dp = world_size() // (cp * tp)

    def run():
        if tp > 1:
            strategy = FSDPTensorParallelStrategy(tensor_parallel_size=tp, context_parallel_size=cp, **options)
        else:
            strategy = FullyShardStrategy(context_parallel_size=cp, **options)
        return parity(strategy, GPTModule, dp, gpt_data())

    return run


class ManualAttentionGPT(GPTModule):
    """The example GPT with its attention written out (softmax of q k^T): nothing to make context-parallel."""

    def __init__(self) -> None:
        super().__init__()
        for block in self.model.blocks:
            block.attn.forward = _manual_attention(block.attn)


def _manual_attention(attn: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        q, k, v = (f(x).view(batch, time, -1, attn.head_dim).transpose(1, 2) for f in (attn.q, attn.k, attn.v))
        scores = (q @ k.transpose(-2, -1)) / attn.head_dim**0.5
        scores = scores.masked_fill(torch.ones(time, time, dtype=torch.bool).triu(1), float("-inf"))
        y = F.softmax(scores, dim=-1) @ v
        return attn.proj(y.transpose(1, 2).reshape(batch, time, -1))

    return forward


class PaddedTokens(Tokens):
    """Token ids with an `attention_mask` hiding each sequence's last two tokens (padding)."""

    def __getitem__(self, i: int) -> Any:
        mask = torch.ones(len(self.ids[i]), dtype=torch.long)
        mask[-2:] = 0
        return {"input_ids": self.ids[i], "labels": self.ids[i], "attention_mask": mask}


def expect_error(make_strategy: Callable[[], Any], make: Callable[[], L.LightningModule], data: Dataset) -> Any:
    """Every rank's error (type and message), gathered on every rank: each must raise alike, none may hang."""
    message = None
    try:
        trainer_for(make_strategy()).fit(make(), DataLoader(data, batch_size=BATCH))
    except Exception as err:
        message = f"{type(err).__name__}: {err}"
    messages: list[Any] = [None] * world_size()
    torch.distributed.all_gather_object(messages, message)
    return messages


def group_context_parallel_errors() -> Iterator[Case]:
    world = world_size()

    def case(name: str, strategy: Callable[[], Any], make: Callable[[], L.LightningModule], data: Callable):
        return Case(f"error_{name}", lambda: expect_error(strategy, make, data()))

    cp = lambda size=world, **kw: lambda: FullyShardStrategy(context_parallel_size=size, **kw)  # noqa: E731
    yield case("sequence_not_divisible", cp(), GPTModule, lambda: Tokens(2 * world + 2))  # inputs 2 x world + 1
    yield case("size_not_dividing_world", cp(world + 1), GPTModule, gpt_data)
    yield case("padding_mask", cp(), HFModule, lambda: PaddedTokens(SEQ))
    yield case("eager_attention", cp(), lambda: HFModule(attn="eager"), lambda: Tokens(SEQ))
    yield case("manual_attention", cp(), ManualAttentionGPT, gpt_data)
    yield case("family_without_sdpa", cp(), lambda: HFModule("Gemma2Config", head_dim=8), lambda: Tokens(SEQ))
    yield case("checkpointing_around_the_blocks", cp(activation_checkpointing=["model"]), GPTModule, gpt_data)
    router_loss = dict(num_experts=4, moe_intermediate_size=16, head_dim=8, output_router_logits=True)
    yield case("router_loss", cp(), lambda: HFModule("Qwen3MoeConfig", **router_loss), lambda: Tokens(SEQ))


def measure_and_estimate(
    strategy: Any, make: Callable[[], Any], data: Tokens, batch: Any = None
) -> tuple[list, Any] | None:
    """One step's activation memory on each rank (`StorageMeter`: gloo's threads free the all-gathers' tensors),
    training `make()` on `data` in batches of 2 under `strategy`, and on rank 0 the activation estimate (the `plan`
    dry run's) of the same layout and batch: `(each rank's (retained, peak), estimate)`; `None` on other ranks."""
    from lightning_dpar.estimates.activations import estimate_activations
    from tests.support.activation_meter import StorageMeter

    meter = StorageMeter()
    trainer = trainer_for(strategy, callbacks=[meter])
    trainer.fit(make(), DataLoader(data, batch_size=2))
    assert meter.measured is not None
    measured: list[Any] = [None] * world_size()
    torch.distributed.all_gather_object(measured, (meter.measured.retained, meter.measured.peak))
    if trainer.global_rank != 0:
        return None
    with torch.device("meta"):
        meta = make()
    dims = trainer.strategy.dims
    shape = (2, len(data.ids[0])) if batch is None else batch  # `batch`: the estimate's own batch, if not token ids
    estimate = estimate_activations(meta, trainer.strategy.module_plan(meta, dims, 0), dims, shape)
    return measured, estimate


def activation_memory(model: str, cp: int, checkpointing: bool = False, loss: str = "whole") -> dict | None:
    """One step's activation memory on each rank (`StorageMeter`: gloo's threads free the all-gathers' tensors) for
    a batch of 2 x 512 tokens per data-parallel rank, under FSDP over every rank with context parallelism `cp` (and
    activation checkpointing of the blocks), and the activation estimate (the `plan` dry run's) for the same layout
    and batch (`loss`: `context_parallel_loss`)."""
    if model == "gpt":
        make, data = (lambda: GPT(vocab_size=256, block_size=512, n_layer=2, n_head=4, n_embd=64)), Tokens(513, n=16)
    else:
        make, data = (lambda: HFModule(hidden_size=64, intermediate_size=128)), Tokens(512, n=16)
    strategy = FullyShardStrategy(
        context_parallel_size=cp, activation_checkpointing=checkpointing, context_parallel_loss=loss
    )
    result = measure_and_estimate(strategy, make, data)
    if result is None:
        return None
    measured, estimate = result
    footprint = estimate.rank(0).per_microbatch(checkpointing)
    return {
        "retained": [r for r, _ in measured],
        "peak": [p for _, p in measured],
        "estimated": {"retained": footprint.retained, "peak": footprint.peak},
    }


def checkpoint_between_layouts() -> dict | None:
    """The example GPT trained 3 steps with CP over every rank and saved; resumed (training nothing more) without CP
    and, on 4 ranks, with CP 2 x FSDP 2, each saving again, and the last loaded back with CP over every rank: the
    model and optimizer state must come through every load unchanged (the format does not depend on CP)."""
    from tests.workers.checkpoint_common import case_dir, flat_tensors, full_optimizer, max_diff

    root = case_dir("cp_checkpoint")
    world = world_size()
    layouts = [world, 1, *([2] if world == 4 else []), world]
    diffs, previous, saved = [], None, None
    for index, cp in enumerate(layouts):
        trainer = trainer_for(FullyShardStrategy(context_parallel_size=cp))
        trainer.fit(GPTModule(), DataLoader(gpt_data(), batch_size=BATCH), ckpt_path=saved)
        state = {**full_params(trainer), **flat_tensors("optim", full_optimizer(trainer))}
        if previous is not None and trainer.global_rank == 0:  # the full state is gathered on rank 0
            diffs.append(max_diff(state, previous))
        previous, saved = state, str(root / f"{index}_cp{cp}.ckpt")
        trainer.save_checkpoint(saved)
    if trainer.global_rank != 0:
        return None
    return {"layouts": layouts, "max_diffs": diffs, "keys": len(previous)}


def group_context_parallel() -> Iterator[Case]:
    world = world_size()
    yield Case(f"gpt_cp{world}", gpt_case(world))
    yield Case(f"llama_cp{world}", hf_case(world))
    yield Case(
        f"llama_cp{world}_ignore_index",
        lambda: parity(FullyShardStrategy(context_parallel_size=world), HFModule, 1, Tokens(SEQ, ignored=True)),
    )
    yield Case("gpt_dpar_cp", lambda: parity("dpar_cp", GPTModule, 1, gpt_data()))
    yield Case(f"gpt_cp{world}_checkpointed", gpt_case(world, activation_checkpointing=True))
    yield Case(f"llama_cp{world}_checkpointed", hf_case(world, checkpointing=True))
    yield Case("checkpoint_between_layouts", checkpoint_between_layouts)
    yield Case("validation_after_fit", validation_after_fit)
    for family in ("Qwen2Config", "Qwen3Config", "MistralConfig"):
        yield Case(f"{family[:-6].lower()}_cp{world}", hf_case(world, family))
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8)
    yield Case(f"qwen3_moe_cp{world}", hf_case(world, "Qwen3MoeConfig", **moe))
    if world == 4:
        yield Case("gpt_cp2_fsdp2", gpt_case(2))
        yield Case("llama_cp2_fsdp2", hf_case(2))
        yield Case("gpt_cp2_tp2", gpt_case(2, tp=2))
        hsdp = lambda: FullyShardStrategy(replicate_size=2, context_parallel_size=2)  # noqa: E731
        yield Case("gpt_cp2_hsdp2", lambda: parity(hsdp(), GPTModule, 2, gpt_data()))
        yield Case("llama_cp2_tp2", hf_case(2, tp=2))
        yield Case("llama_cp2_tp2_checkpointed", hf_case(2, tp=2, checkpointing=True))


def group_context_parallel_memory() -> Iterator[Case]:
    for model in ("gpt", "llama"):
        for cp in sorted({1, 2, world_size()}):
            yield Case(f"memory_{model}_cp{cp}", lambda m=model, c=cp: activation_memory(m, c))
    world = world_size()
    yield Case(f"memory_gpt_cp{world}_checkpointed", lambda: activation_memory("gpt", world, checkpointing=True))


def group_context_parallel_loss() -> Iterator[Case]:
    """`context_parallel_loss="per_rank"`: in `tests/workers/context_parallel_per_rank.py`, which builds on this
    module's cases."""
    from tests.workers.context_parallel_per_rank import group_context_parallel_loss as cases

    yield from cases()


GROUPS = {
    "context_parallel_loss": group_context_parallel_loss,
    "context_parallel_memory": group_context_parallel_memory,
    "context_parallel": group_context_parallel,
    "context_parallel_errors": group_context_parallel_errors,
}
