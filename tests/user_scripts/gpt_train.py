"""A user's training script, as a user writes it: the model is defined here, in `__main__`, with its own
`train_dataloader()`; only `torch`, `lightning` and `lightning_dpar` are imported (the tests copy this file alone to
a temporary directory and run it there, so nothing else of the repository is importable).

`python gpt_train.py OUT CASE [CASE ...]` (Lightning re-runs it per rank), or `torchrun --nproc-per-node N
gpt_train.py OUT CASE ...`. Each case trains with real Trainers and writes `OUT/CASE.json` on rank 0: its
measurements, or the traceback it raised (`{"error": ...}`), so one broken case fails only its own test.

Cases:
- `auto`: `dpar_auto` (the script's module searched in a forked child), the chosen layout by hand, one process.
- `auto_budget`: the same with `device_memory` just below the unconstrained choice's peak (a leaner layout).
- `auto_split`: a budget below every layout that neither pipelines nor tensor-parallelises (the model is split).
- `auto_refused`: a budget no layout fits: the documented refusal, with its own message.
- `names`: the registered strategy names (those of 2 ranks and more), each at parity with one process.
- `ft`: `dpar_ft_hsdp`, one torchft replica group (under torchrun, with `$TORCHFT_LIGHTHOUSE` set).
- `pipeline`, `context_parallel`, `experts`: those features on the script's model, at parity with one process.
- `checkpoint`: a sharded save, `fit(ckpt_path=...)` resuming it exactly, a full-format save read back by
  `ScriptGPT.load_from_checkpoint`; leaves `OUT/sharded.ckpt` for `consolidate`.
- `spawn`: `start_method="spawn"` (the module pickled to fresh processes), under `dpar_auto`; alone in its run
  (after another case this process is a rank already, and Lightning launches nothing).

`python gpt_train.py ray OUT`: Ray Train's recipe, the training function and the model sent to the workers by value
(as Ray sends what `__main__` defines), under `dpar_auto`; writes `OUT/ray.json`. `python gpt_train.py fit ...`:
this script's own `LightningCLI(ScriptGPT)`.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import traceback
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import lightning_dpar
from lightning_dpar.examples.gpt import GPT

VOCAB, SEQ, BATCH, STEPS = 64, 8, 4, 3
DEVICES = int(os.environ.get("SCRIPT_DEVICES", "2"))  # the ranks every Trainer here trains on, on one node


class Tokens(Dataset):
    """64 fixed random sequences of `SEQ + 1` token ids (the model reads `SEQ`, predicts the next)."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, VOCAB, (64, SEQ + 1), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i]


class ScriptGPT(GPT):
    """The bundled GPT, 4 small layers (4 experts with `n_experts=4`), SGD with momentum, its own data."""

    def __init__(self, n_experts: int = 0) -> None:
        torch.manual_seed(0)
        super().__init__(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=4, n_embd=32, n_experts=n_experts)

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(Tokens(), batch_size=BATCH)


def trainer(strategy, max_steps: int = STEPS, **kwargs) -> L.Trainer:
    settings = dict(
        accelerator="cpu",
        devices=DEVICES,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(**{**settings, **kwargs})


def full_state(fitted: L.Trainer) -> dict[str, torch.Tensor]:
    """The whole model's parameters on every rank (each pipeline stage gathers its own, then they are exchanged)."""
    options = StateDictOptions(full_state_dict=True)  # on every rank (`cpu_offload` would keep it on rank 0 only)
    state = get_model_state_dict(fitted.lightning_module, options=options)
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: v.detach().cpu() for k, v in state.items()})
    return {k: v for part in parts for k, v in part.items()}


def one_process(data_parallel: int, steps: int = STEPS, **model_kwargs) -> dict[str, torch.Tensor]:
    """The same model trained in this process on the global batches the data-parallel ranks share (Lightning's
    distributed sampler shuffles a training loader, with seed 0 when none is set)."""
    module = ScriptGPT(**model_kwargs)
    optimizer = module.configure_optimizers()
    data = Tokens()
    shares = [list(DistributedSampler(data, data_parallel, r, shuffle=True, seed=0)) for r in range(data_parallel)]
    for step in range(steps):
        batch = torch.stack([data[i] for share in shares for i in share[step * BATCH : (step + 1) * BATCH]])
        optimizer.zero_grad()
        module.training_step(batch, step).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def fit_against_one_process(strategy, **model_kwargs) -> dict:
    fitted = trainer(strategy)
    fitted.fit(ScriptGPT(**model_kwargs))
    got = full_state(fitted)
    data_parallel = fitted.strategy.distributed_sampler_kwargs["num_replicas"]
    return {"steps": fitted.global_step, "vs_one_process": difference(got, one_process(data_parallel, **model_kwargs))}


@functools.cache
def unconstrained_search():
    """The search `dpar_auto` makes without a memory budget, from which the budget cases derive theirs: one forked
    search, made once and kept (a search is deterministic: the same model and world give the same result). It is
    made where the budget cases run, not taken from the `auto` case: on torch's CUDA builds a search forked after a
    backward falls back to the formula (docs/auto-layout.md), and the budgets must come from the search they bound."""
    from lightning_dpar.layout_search.isolated import search_anywhere
    from lightning_dpar.layout_search.profiles import PRESETS

    return search_anywhere(ScriptGPT(), DEVICES, 1, PRESETS["cpu-gloo"], BATCH, in_child=True)


def auto(device_memory: float | None = None) -> dict:
    strategy = lightning_dpar.AutoParallelStrategy(device_memory=device_memory)
    fitted = trainer(strategy)
    fitted.fit(ScriptGPT())
    got, layout = full_state(fitted), strategy.chosen
    by_hand = trainer(lightning_dpar.FSDPTensorParallelStrategy(**layout.strategy_kwargs()))
    by_hand.fit(ScriptGPT())
    return {
        "chosen": layout.describe(),
        "runners_up": [e.layout.describe() for e in strategy.search_result.ranked[1:3]],
        "peak": strategy.search_result.best.memory.total,
        "device_memory": strategy.search_result.profile.device_memory,
        "steps": fitted.global_step,
        "auto_vs_hand": difference(got, full_state(by_hand)),
        "auto_vs_one_process": difference(got, one_process(layout.dims.data_parallel)),
    }


def auto_budget() -> dict:
    first = unconstrained_search().best
    budget = (first.memory.total - 1) / 2**30
    return {"first": first.layout.describe(), "first_peak": first.memory.total, **auto(budget)}


def auto_split() -> dict:
    """A budget just below every layout without pipeline or tensor parallelism: the search must split the model."""
    ranked = unconstrained_search().ranked
    plain = [e.memory.total for e in ranked if e.layout.dims.pipeline == e.layout.dims.tensor_parallel == 1]
    return auto((min(plain) - 1) / 2**30)


def auto_refused() -> dict:
    try:
        trainer(lightning_dpar.AutoParallelStrategy(device_memory=1e-6)).fit(ScriptGPT())
    except ValueError as err:
        return {"refusal": str(err)}
    return {"refusal": None}


def names() -> dict:
    chosen = ["dpar_replicate", "dpar_fsdp", "dpar_fsdp_offload", "dpar_hsdp", "dpar_2d", "dpar_cp"]
    return {name: fit_against_one_process(name) for name in chosen}


def pipeline() -> dict:
    strategy = lightning_dpar.FSDPTensorParallelStrategy(
        tensor_parallel_size=1, pipeline_parallel_size=2, pipeline_microbatches=2
    )
    return fit_against_one_process(strategy)


def context_parallel() -> dict:
    return fit_against_one_process(lightning_dpar.FullyShardStrategy(context_parallel_size=2))


def experts() -> dict:
    return fit_against_one_process(lightning_dpar.FullyShardStrategy(expert_parallel_size=2), n_experts=4)


def checkpoint(out: Path) -> dict:
    """Two steps saved (sharded), resumed to four; the uninterrupted four; a full save loaded back."""
    first = trainer("dpar_fsdp", max_steps=2)
    first.fit(ScriptGPT())
    first.save_checkpoint(out / "sharded.ckpt")
    resumed = trainer("dpar_fsdp", max_steps=4)
    resumed.fit(ScriptGPT(), ckpt_path=out / "sharded.ckpt")
    whole = trainer("dpar_fsdp", max_steps=4)
    whole.fit(ScriptGPT())
    full = trainer(lightning_dpar.FullyShardStrategy(checkpoint_format="full"), max_steps=2)
    full.fit(ScriptGPT())
    full.save_checkpoint(out / "full.ckpt")
    got_full = full_state(full)
    dist.barrier()
    loaded = ScriptGPT.load_from_checkpoint(out / "full.ckpt", map_location="cpu")
    return {
        "resumed_steps": resumed.global_step,
        "resumed_vs_whole": difference(full_state(resumed), full_state(whole)),
        "loaded_type": type(loaded).__qualname__,
        "loaded_vs_saved": difference(loaded.state_dict(), got_full),
    }


def ft() -> dict:
    return fit_against_one_process("dpar_ft_hsdp")


def spawn() -> dict:
    strategy = lightning_dpar.AutoParallelStrategy(start_method="spawn")
    fitted = trainer(strategy)
    fitted.fit(ScriptGPT())  # the ranks are spawned processes; the trained weights come back to this one
    got = {k: v.detach().clone() for k, v in fitted.lightning_module.state_dict().items()}
    return {"vs_one_process": difference(got, one_process(2))}


CASES = {
    "auto": auto,
    "auto_budget": auto_budget,
    "auto_split": auto_split,
    "auto_refused": auto_refused,
    "names": names,
    "pipeline": pipeline,
    "context_parallel": context_parallel,
    "experts": experts,
    "checkpoint": None,  # needs OUT
    "ft": ft,
    "spawn": spawn,
}


def ray_worker(config: dict) -> None:
    """Ray's Lightning recipe, with `lightning_dpar.ray.prepare_trainer`, on this script's model."""
    from ray.train.lightning import RayLightningEnvironment

    from lightning_dpar.ray import prepare_trainer

    strategy = lightning_dpar.AutoParallelStrategy()
    fitted = prepare_trainer(trainer(strategy, plugins=[RayLightningEnvironment()]))
    fitted.fit(ScriptGPT())
    got = full_state(fitted)
    if dist.get_rank() == 0:
        result = {"chosen": strategy.chosen.describe(), "vs_one_process": difference(got, one_process(2))}
        (Path(config["out"]) / "ray.json").write_text(json.dumps(result))


def ray_driver(out: Path) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    TorchTrainer(
        ray_worker,
        train_loop_config={"out": str(out.resolve())},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str((out / "ray").resolve()), name="script"),
    ).fit()


if __name__ == "__main__":
    if sys.argv[1] == "fit":
        from lightning.pytorch.cli import LightningCLI

        LightningCLI(ScriptGPT)
        sys.exit()
    if sys.argv[1] == "ray":
        ray_driver(Path(sys.argv[2]))
        sys.exit()
    out = Path(sys.argv[1])
    for case in sys.argv[2:]:
        try:
            result = checkpoint(out) if case == "checkpoint" else CASES[case]()
        except Exception:
            result = {"error": traceback.format_exc()}
        if not dist.is_initialized() or dist.get_rank() == 0:
            (out / f"{case}.json").write_text(json.dumps(result, indent=1))
