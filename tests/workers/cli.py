"""Cases for `tests/launched/test_cli.py`: every `examples/configs/*.yaml` trained for a few steps through the real CLI
(`lightning_dpar.cli.cli_main`), one case per config, all in one torchrun launch of 4 ranks (Lightning is imported
once, the process group is reused)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

from tests.workers.cases import Case
from tests.workers.common import full_params

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"
STEPS = 4
#: A smaller GPT and less data than the example's defaults, so each config trains in seconds.
TINY = [
    f"--trainer.max_steps={STEPS}",
    "--trainer.val_check_interval=2",
    "--trainer.limit_val_batches=1",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--model.n_embd=64",
    "--model.block_size=32",
    "--data.block_size=32",
    "--data.batch_size=4",
    "--data.max_bytes=40000",
]


def _placement(module: torch.nn.Module, name: str) -> list[str] | None:
    if name not in dict(module.named_parameters()):  # another pipeline stage's (only rank 0's result is read)
        return None
    param = module.get_parameter(name)
    return [str(p) for p in param.placements] if isinstance(param, DTensor) else None


def run_config(name: str, args: list[str] | None = None) -> dict:
    """Train `examples/configs/<name>.yaml` (or, given `args`, the CLI's defaults with those arguments)."""
    from lightning_dpar.cli import cli_main  # here: other worker groups need not import LightningCLI

    workdir = Path(sys.argv[2]).parent / "cli" / name  # same path on every rank
    workdir.mkdir(parents=True, exist_ok=True)
    os.chdir(workdir)
    cli = cli_main(["fit", *(args if args is not None else ["--config", str(CONFIGS / f"{name}.yaml")]), *TINY])
    trainer, module = cli.trainer, cli.model
    dims = trainer.strategy.dims
    last = workdir / "checkpoints" / "gpt" / "last.ckpt"
    dist.barrier()  # every rank's checkpoint files are written before rank 0 lists them
    return {
        "strategy": type(trainer.strategy).__name__,
        "dims": [dims.replicate, dims.shard, dims.tensor_parallel],
        "pipeline": dims.pipeline,
        "global_step": trainer.global_step,
        "train_loss": float(trainer.callback_metrics["train_loss"]),
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "q_placement": _placement(module, "model.blocks.0.attn.q.weight"),
        "ln_placement": _placement(module, "model.blocks.0.ln_1.weight"),
        "checkpoint_files": sorted(p.name for p in last.iterdir()) if last.is_dir() else [],
        "precision": trainer.precision,
        "param_dtypes": sorted({str(p.dtype) for p in module.parameters()}),
        "local_shapes": {
            name: list(p.to_local().shape if isinstance(p, DTensor) else p.shape)
            for name, p in module.named_parameters()
        },
    }


class BatchRecorder(Callback):
    """Each training batch's global step and token sum on this rank: what the README's resume must reproduce."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        tensors = batch if isinstance(batch, (list, tuple)) else [batch]
        self.batches.append([trainer.global_step, sum(int(t.sum()) for t in tensors)])


def _fit(workdir: Path, *args: str) -> tuple[list[list[int]], dict[str, torch.Tensor]]:
    """`python -m lightning_dpar fit` on the tiny settings plus `args` in `workdir`: every rank's batches, and the
    full final weights on rank 0."""
    from lightning_dpar.cli import cli_main

    workdir.mkdir(parents=True, exist_ok=True)
    os.chdir(workdir)
    cli = cli_main(["fit", *TINY, "--trainer.callbacks+=tests.workers.cli.BatchRecorder", *args])
    recorder = next(c for c in cli.trainer.callbacks if isinstance(c, BatchRecorder))
    every_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, recorder.batches)
    return every_rank, full_params(cli.trainer)


def readme_resume_case() -> dict | None:
    """The README's resume: `fit` to step 3, then `fit --ckpt_path last --trainer.max_steps=5`, against one `fit` to
    step 5: the same batches on every rank from step 3 on, and the same final weights."""
    root = Path(sys.argv[2]).parent / "cli" / "readme_resume"
    full_batches, full_weights = _fit(root / "uninterrupted", "--trainer.max_steps=5")
    _fit(root / "interrupted", "--trainer.max_steps=3")
    resumed_batches, resumed_weights = _fit(root / "interrupted", "--ckpt_path", "last", "--trainer.max_steps=5")
    if dist.get_rank() != 0:
        return None
    return {
        "expected": [[b for b in rank if b[0] >= 3] for rank in full_batches],
        "resumed": resumed_batches,
        "weights_max_diff": max((full_weights[k] - resumed_weights[k]).abs().max().item() for k in full_weights),
        "same_keys": sorted(full_weights) == sorted(resumed_weights),
    }


def example_configs() -> Iterator[Case]:
    for config in sorted(CONFIGS.glob("*.yaml")):
        yield Case(f"config_{config.stem}", lambda name=config.stem: run_config(name))
    # The README's 3D command: the registered name on the example's defaults.
    yield Case("strategy_dpar_3d", lambda: run_config("dpar_3d", ["--trainer.strategy=dpar_3d"]))
    yield Case("readme_resume", readme_resume_case)


GROUPS = {"example_configs": example_configs}
