"""Cases for `tests/launched/test_compile.py`: the strategies' `compile` argument through real Trainers.

Each case trains the same model on the same data eagerly and compiled in one process and records losses, final
parameters, state-dict keys and dynamo's compile counters per step.
"""

from __future__ import annotations

import functools
import itertools
import os
import shutil
from collections.abc import Iterator

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, ReplicateStrategy
from tests.support.models import TP_PLAN, Net, ParityModule, RegressionData, loader
from tests.workers.cases import Case, one_case
from tests.workers.common import BATCH, full_params, trainer_for

COMPILE_STEPS = 6


class StepRecorder(L.Callback):
    """Loss and dynamo's cumulative compile counters after every optimizer step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.graphs: list[int] = []
        self.backward_captures: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())
        self.graphs.append(counters["stats"]["unique_graphs"])
        self.backward_captures.append(counters["compiled_autograd"]["captures"])


class DirectInputNet(Net):
    """`Net` with a linear layer `mix` before the blocks that feeds the first block directly, no eager operation in
    between. Split row-wise, `mix` ends with an asynchronous all-reduce of its output, handed on as an
    `AsyncCollectiveTensor`: what a transformers model's row-wise token embedding hands to the first decoder layer.
    Width 16, which the row-wise split needs to divide by 2."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__(dim=dim)
        self.mix = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mix(F.relu(self.inp(x)))
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


class DirectInputModule(ParityModule):
    def __init__(self, optimizer: str = "adam") -> None:
        super().__init__(optimizer=optimizer)
        torch.manual_seed(0)
        self.model = DirectInputNet()


def _train(strategy, steps: int = COMPILE_STEPS, module_class=ParityModule, **trainer_kwargs):
    recorder = StepRecorder()
    module = module_class(optimizer="adam")
    trainer = trainer_for(strategy, max_steps=steps, callbacks=[recorder], **trainer_kwargs)
    trainer.fit(module, loader(RegressionData(), BATCH))
    return trainer, module, recorder


def _deltas(values: list[int]) -> list[int]:
    """New graphs / captures per step (the first entry includes everything compiled before step 1)."""
    return [values[0]] + [b - a for a, b in itertools.pairwise(values)]


COMPILE_CASES = {
    "fsdp": lambda **kw: FullyShardStrategy(**kw),
    "fsdp_activation_checkpointing": lambda **kw: FullyShardStrategy(activation_checkpointing=True, **kw),
    "2d": lambda **kw: FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=TP_PLAN, **kw),
    # A row-wise layer outside the compiled blocks whose all-reduced output is the first compiled block's input.
    "2d_tensor_parallel_input_layer": lambda **kw: FSDPTensorParallelStrategy(
        tensor_parallel_size=2, tp_plan={**TP_PLAN, "model.mix": "rowwise_split_input"}, **kw
    ),
    "replicate": lambda **kw: ReplicateStrategy(**kw),
    "replicate_bf16_hook": lambda **kw: ReplicateStrategy(comm_hook="bf16_compress", **kw),
    "replicate_fp16_hook": lambda **kw: ReplicateStrategy(comm_hook="fp16_compress", **kw),
}
#: Cases trained on another module than `ParityModule`.
CASE_MODULES = {"2d_tensor_parallel_input_layer": DirectInputModule}
#: Compiled-autograd variants, compared against the eager run of the case named second.
COMPILED_AUTOGRAD_CASES = {
    "replicate_compiled_autograd": "replicate",
    "replicate_compiled_autograd_bf16_hook": "replicate_bf16_hook",
}


@functools.cache
def eager_run(name: str) -> dict:
    """The eager run of `COMPILE_CASES[name]`, kept for every compiled case compared against it."""
    trainer, module, recorder = _train(COMPILE_CASES[name](), module_class=CASE_MODULES.get(name, ParityModule))
    return {
        "losses": recorder.losses,
        "params": full_params(trainer),
        "state_keys": sorted(module.state_dict()),
        "checkpoint_keys": sorted(trainer.strategy.lightning_module_state_dict()),
    }


def compiled_case(reference: str, make_strategy, module_class=ParityModule) -> dict | None:
    """Train compiled and compare with the eager run named `reference`, with dynamo's counters per step."""
    want = eager_run(reference)
    # Forget earlier cases' compiled code, so each case must compile its own graphs in step 1: a compile that dynamo
    # silently skipped would show as zero graphs instead of hiding behind another case's cache.
    torch._dynamo.reset()
    graphs_before = counters["stats"]["unique_graphs"]
    captures_before = counters["compiled_autograd"]["captures"]
    buckets_before = counters["inductor"]["ddp_buckets"]
    trainer, module, recorder = _train(make_strategy(), module_class=module_class)
    params = full_params(trainer)
    compiled_units = sorted(
        fqn for fqn, m in module.named_modules() if getattr(m, "_compiled_call_impl", None) is not None
    )
    if trainer.global_rank != 0:
        return None
    return {
        "loss_max_diff": max(abs(a - b) for a, b in zip(recorder.losses, want["losses"])),
        "param_max_diff": max((params[k] - want["params"][k]).abs().max().item() for k in want["params"]),
        "steps": len(recorder.losses),
        "new_graphs_per_step": _deltas([g - graphs_before for g in recorder.graphs]),
        "backward_captures_per_step": _deltas([c - captures_before for c in recorder.backward_captures]),
        "compiled_units": compiled_units,
        "inductor_ddp_buckets": counters["inductor"]["ddp_buckets"] - buckets_before,
        "state_keys_equal": sorted(module.state_dict()) == want["state_keys"],
        "checkpoint_keys_equal": sorted(trainer.strategy.lightning_module_state_dict()) == want["checkpoint_keys"],
        "orig_mod_in_keys": any("_orig_mod" in k for k in module.state_dict()),
    }


def group_compile() -> Iterator[Case]:
    for name, make in COMPILE_CASES.items():
        module_class = CASE_MODULES.get(name, ParityModule)
        yield Case(
            f"compile_{name}",
            lambda name=name, make=make, module_class=module_class: compiled_case(
                name, lambda: make(compile=True), module_class
            ),
        )
    for name, reference in COMPILED_AUTOGRAD_CASES.items():
        make = COMPILE_CASES[reference]
        yield Case(
            f"compile_{name}",
            lambda reference=reference, make=make: compiled_case(
                reference, lambda: make(compile={"fullgraph": False}, compiled_autograd=True)
            ),
        )


def compile_resume_case():
    """A checkpoint written by a compiled run loads into an eager one: same keys, same values."""
    import tempfile

    path = [tempfile.mkdtemp() + "/compiled.ckpt"]
    dist.broadcast_object_list(path)
    trainer, _, _ = _train(FullyShardStrategy(compile=True), steps=2)
    trainer.save_checkpoint(path[0])
    saved = full_params(trainer)
    # max_steps already reached by the checkpoint: fit only restores it.
    resumed = trainer_for(FullyShardStrategy(), max_steps=2)
    resumed.fit(ParityModule(optimizer="adam"), loader(RegressionData(), BATCH), ckpt_path=path[0])
    loaded = full_params(resumed)
    dist.barrier()
    if resumed.global_rank != 0:
        return None
    shutil.rmtree(os.path.dirname(path[0]), ignore_errors=True)
    return {
        "global_step": resumed.global_step,
        "max_abs_diff": max((saved[k] - loaded[k]).abs().max().item() for k in saved),
        "same_keys": sorted(saved) == sorted(loaded),
    }


GROUPS = {"compile": group_compile, "compile_resume": one_case("compile_resume", compile_resume_case)}
