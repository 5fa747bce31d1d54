"""Mixture-of-Experts models through real Trainers, with and without expert parallelism: tiny transformers
Qwen3-MoE and Mixtral (4 experts, top-2) and the example GPT's MoE variant, each ending with the same parameters as
single-process training of the same model on the same global batches."""

from __future__ import annotations

from collections.abc import Iterator

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy
from lightning_dpar.examples.gpt import GPT
from tests.support import moe
from tests.workers.cases import Case
from tests.workers.checkpoint_common import case_dir, flat_tensors, full_optimizer, max_diff
from tests.workers.common import BATCH, full_params, trainer_for, world_size
from tests.workers.hf_models import SEQ, VOCAB, TokenIds, global_batches

EXPERTS = 4


class HFMoEModule(L.LightningModule):
    """A transformers MoE causal LM; the loss is its own (`labels`), with the router's load-balancing loss when the
    config sets `output_router_logits`."""

    def __init__(self, family: str = "qwen3_moe", depth: int = 2, **overrides) -> None:
        super().__init__()
        from transformers import MixtralForCausalLM, Qwen3MoeForCausalLM

        torch.manual_seed(0)
        settings = dict(vocab_size=VOCAB, max_position_embeddings=SEQ, num_hidden_layers=depth, **overrides)
        if family == "qwen3_moe":
            self.net = Qwen3MoeForCausalLM(moe.config(family, norm_topk_prob=True, **settings))
        else:
            self.net = MixtralForCausalLM(moe.config(family, **settings))

    def training_step(self, batch, batch_idx):
        return self.net(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class ExampleMoE(GPT):
    """The example GPT with 4 experts per block; SGD so that the comparison measures gradients."""

    def __init__(self, grouped: bool = False) -> None:
        torch.manual_seed(0)
        super().__init__(
            vocab_size=VOCAB,
            block_size=SEQ,
            n_layer=2,
            n_head=4,
            n_embd=16,
            n_experts=EXPERTS,
            experts_grouped_mm=grouped,
        )

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class IdleExpertMoE(ExampleMoE):
    """The router never chooses the last expert (its score's bias is -1e4): with expert parallelism the rank holding
    it receives no token for it (on 4 ranks, no token at all), in every step."""

    def __init__(self) -> None:
        super().__init__()
        with torch.no_grad():
            for block in self.model.blocks:
                block.mlp.router.score.bias[EXPERTS - 1] = -1e4


def reference(
    module: L.LightningModule, batches: list[torch.Tensor], clip: float | None = None
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Single-process training on the global batches; the state, and each step's gradient norm before clipping."""
    optimizer = module.configure_optimizers()
    norms = []
    for batch in batches:
        optimizer.zero_grad()
        module.training_step(batch, 0).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(module.parameters(), clip if clip else float("inf")).item())
        optimizer.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, norms


def expert_shards(module: L.LightningModule) -> dict[str, object]:
    """How rank 0 holds the first experts module's first parameter: its placements and local rows."""
    for name, param in module.named_parameters():
        if ".experts." in name and isinstance(param, DTensor):
            return {"name": name, "placements": str(param.placements), "local_rows": param.to_local().shape[0]}
    return {}


def parity_case(
    strategy, dp: int, make=HFMoEModule, steps: int = 3, clip: float | None = None, accumulate: int = 1
) -> dict | None:
    """Train under `strategy` (clipping the gradients' global norm to `clip`, accumulating `accumulate` batches per
    step); on rank 0, the largest difference to single-process training of the same model on the same global
    batches, and the reference's gradient norms before clipping."""
    data = TokenIds()
    trainer = trainer_for(strategy, max_steps=steps, gradient_clip_val=clip, accumulate_grad_batches=accumulate)
    module = make()
    initial = {k: v.detach().clone() for k, v in make().state_dict().items()}
    trainer.fit(module, DataLoader(data, batch_size=BATCH))
    got = full_params(trainer)
    shards = expert_shards(module)
    if trainer.global_rank != 0:
        return None
    batches = global_batches(data, dp, 0, steps * accumulate)
    merged = [torch.cat(batches[s * accumulate : (s + 1) * accumulate]) for s in range(steps)]
    want, norms = reference(make(), merged, clip)
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    moved = {k: (got[k][-1] - initial[k][-1]).abs().max().item() for k in got if ".experts." in k}
    return {
        "max_abs_diff": max((got[k] - want[k]).abs().max().item() for k in want),
        "reference_norms": norms,
        "last_expert_moved": moved,
        **shards,
    }


class CaptureLoadedState(L.Callback):
    """The full model and optimizer state as training starts, after a checkpoint was loaded (a collective)."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.state = _model_and_optimizer(trainer)


#: The resharding chain: (expert_parallel_size, the step each stage trains to); each stage resumes the previous one.
CHAIN = [(2, 2), (1, 3), (4, 4)]


def refusal_case(make_strategy, make_module) -> list[str | None]:
    """Every rank's error (None where it trained), gathered: a refused layout must fail on every rank, before any
    collective (one that hung would time the case out)."""
    message = None
    try:
        trainer_for(make_strategy()).fit(make_module(), DataLoader(TokenIds(), batch_size=BATCH))
    except Exception as err:
        message = f"{type(err).__name__}: {err}"
    messages: list[str | None] = [None] * world_size()
    dist.all_gather_object(messages, message)
    return messages


def full_format_case() -> dict | None:
    """Expert parallelism over every rank saves a full-format checkpoint (one file, gathered on rank 0) after 2
    steps; FSDP without expert parallelism resumes it and trains step 3, matching one process."""
    data = TokenIds()
    world = world_size()
    path = case_dir("moe_full_format") / "step2.ckpt"
    first = trainer_for(FullyShardStrategy(expert_parallel_size=world, checkpoint_format="full"), max_steps=2)
    first.fit(HFMoEModule(), DataLoader(data, batch_size=BATCH))
    first.save_checkpoint(path)
    second = trainer_for(FullyShardStrategy(checkpoint_format="full"), max_steps=3)
    second.fit(HFMoEModule(), DataLoader(data, batch_size=BATCH), ckpt_path=path)
    got = full_params(second)
    if second.global_rank != 0:
        return None
    want, _ = reference(HFMoEModule(), global_batches(data, world, 0, 3))
    return {"max_abs_diff": max((got[k] - want[k]).abs().max().item() for k in want), "is_file": path.is_file()}


def reshard_chain_case() -> dict | None:
    """EP 2 x FSDP 2 trains 2 steps and saves; FSDP 4 (no expert parallelism) resumes it and trains step 3; EP 4
    resumes that and trains step 4. Each stage's model and optimizer state right after loading must equal what the
    previous stage saved, and its training must match single-process training up to its step (the exact next
    batch, with the momentum carried over)."""
    data = TokenIds()
    directory = case_dir("moe_reshard_chain")
    results: dict[str, object] = {}
    saved_state: dict[str, torch.Tensor] | None = None
    for index, (expert, steps) in enumerate(CHAIN):
        module = HFMoEModule()
        trainer = trainer_for(FullyShardStrategy(expert_parallel_size=expert), max_steps=steps)
        capture = CaptureLoadedState()
        trainer.callbacks.append(capture)
        ckpt = directory / f"stage{index - 1}.ckpt" if index else None
        trainer.fit(module, DataLoader(data, batch_size=BATCH), ckpt_path=ckpt)
        trainer.save_checkpoint(directory / f"stage{index}.ckpt")
        got = full_params(trainer)
        state = _model_and_optimizer(trainer)
        if trainer.global_rank == 0:
            want, _ = reference(HFMoEModule(), global_batches(data, 4, 0, steps))
            stage = f"ep{expert}_step{steps}"
            results[stage] = {
                "max_abs_diff": max((got[k] - want[k]).abs().max().item() for k in want),
                "global_step": trainer.global_step,
                "load_diff": max_diff(capture.state, saved_state) if saved_state is not None else None,
                "state_entries": len(state),
            }
        saved_state = state
    return results if trainer.global_rank == 0 else None


def _model_and_optimizer(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    state = {f"model.{k}": v for k, v in full_params(trainer).items()}
    state.update(flat_tensors("optim", full_optimizer(trainer)))
    return state


def group_moe() -> Iterator[Case]:
    world = world_size()
    yield Case("qwen3_moe_fsdp", lambda: parity_case(FullyShardStrategy(), world))
    yield Case("qwen3_moe_ep", lambda: parity_case(FullyShardStrategy(expert_parallel_size=world), world))
    yield Case("example_moe_ep", lambda: parity_case(FullyShardStrategy(expert_parallel_size=world), world, ExampleMoE))
    yield Case(
        "example_moe_ep_grouped_mm",
        lambda: parity_case(FullyShardStrategy(expert_parallel_size=world), world, lambda: ExampleMoE(grouped=True)),
    )
    yield Case(
        "example_moe_idle_expert",
        lambda: parity_case(FullyShardStrategy(expert_parallel_size=world), world, IdleExpertMoE),
    )
    # The router's load-balancing loss (coefficient 0.1): over the global batch, as one process computes it.
    aux = dict(output_router_logits=True, router_aux_loss_coef=0.1)
    yield Case("qwen3_moe_aux_fsdp", lambda: parity_case(FullyShardStrategy(), world, lambda: HFMoEModule(**aux)))
    yield Case(
        "qwen3_moe_aux_ep",
        lambda: parity_case(FullyShardStrategy(expert_parallel_size=world), world, lambda: HFMoEModule(**aux)),
    )
    yield Case(
        "qwen3_moe_ep_checkpointed",  # activation checkpointing: backward recomputes the dispatch on every rank
        lambda: parity_case(FullyShardStrategy(expert_parallel_size=world, activation_checkpointing=True), world),
    )
    yield Case(
        "qwen3_moe_ep_accumulated",
        lambda: parity_case(FullyShardStrategy(expert_parallel_size=world), world, steps=2, accumulate=2),
    )
    yield Case(
        "ep_on_dense_refused",
        lambda: refusal_case(lambda: FullyShardStrategy(expert_parallel_size=2), lambda: GPT(n_embd=16, n_head=2)),
    )
    yield Case(
        "ep_indivisible_refused",
        lambda: refusal_case(
            lambda: FullyShardStrategy(expert_parallel_size=world), lambda: HFMoEModule(num_experts=world + 1)
        ),
    )
    yield Case(
        "ep_size_refused",
        lambda: refusal_case(lambda: FullyShardStrategy(expert_parallel_size=3), HFMoEModule),
    )
    yield Case(
        "qwen3_moe_ep_clipped",
        lambda: parity_case(FullyShardStrategy(expert_parallel_size=world), world, clip=0.05),
    )
    if world == 2:  # compiling costs about 20 s: once
        yield Case(
            "example_moe_ep_compiled",
            lambda: parity_case(FullyShardStrategy(expert_parallel_size=2, compile=True), 2, ExampleMoE),
            timeout_s=600,
        )
    if world == 4:
        yield Case("qwen3_moe_ep2_fsdp2", lambda: parity_case(FullyShardStrategy(expert_parallel_size=2), 4))
        yield Case(
            "mixtral_ep2_fsdp2",
            lambda: parity_case(FullyShardStrategy(expert_parallel_size=2), 4, lambda: HFMoEModule("mixtral")),
        )
        yield Case(
            "qwen3_moe_ep2_tp2",
            lambda: parity_case(
                FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan="auto", expert_parallel_size=2), 2
            ),
        )
        yield Case(
            "qwen3_moe_pp2_ep2",
            lambda: parity_case(FullyShardStrategy(pipeline_parallel_size=2, expert_parallel_size=2), 2),
        )
        yield Case("moe_reshard_chain", reshard_chain_case)
        yield Case("moe_full_format", full_format_case)
        yield Case(
            "qwen3_moe_hsdp_ep2",
            lambda: parity_case(FullyShardStrategy(replicate_size=2, expert_parallel_size=2), 4),
        )


GROUPS = {"moe": group_moe}
