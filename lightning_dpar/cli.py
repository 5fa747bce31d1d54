"""`python -m lightning_dpar fit|validate|test|predict`: Lightning's `LightningCLI` with the bundled example as
its default configuration.

The defaults live in `lightning_dpar/examples/default.yaml` (shipped in the package, so the command works from any
install); `--config FILE` and `--section.key=value` arguments are layered on top, as in any LightningCLI program.
Any LightningModule / LightningDataModule can replace the example through `model.class_path` / `data.class_path`.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

import torch
from jsonargparse import Namespace
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities import rank_zero_info

import lightning_dpar  # registers the strategy names before any config is parsed

__all__ = [
    "DparCLI",
    "cli_main",
    "strategy_class_path",
]

#: The configuration every subcommand starts from: the GPT example on 4 CPU processes with `dpar_2d`.
DEFAULT_CONFIG = Path(__file__).parent / "examples" / "default.yaml"
TRAINER_SUBCOMMANDS = ("fit", "validate", "test", "predict")

#: What `trainer.strategy: auto` (the default) means here: TP 2 x FSDP 2 on the default 4 processes, FSDP alone
#: (`tensor_parallel_size=1`) on a device count TP 2 does not divide (one GPU, say). It is applied after parsing
#: instead of being a `class_path` default because jsonargparse carries a default's init_args over to any other
#: strategy class the user picks (a `ReplicateStrategy` would silently inherit `tensor_parallel_size: 2`).
DEFAULT_STRATEGY = Namespace(
    class_path="lightning_dpar.FSDPTensorParallelStrategy",
    init_args=Namespace(tensor_parallel_size=2),  # data_parallel_size "auto": the rest of the world
)


class DparCLI(LightningCLI):
    """LightningCLI with two strategy conveniences, applied after parsing:

    - `trainer.strategy: auto` (the default) becomes `DEFAULT_STRATEGY`, the example's TP 2 x FSDP 2;
    - a bare strategy class name (`--trainer.strategy=FSDPTensorParallelStrategy`) works. `Trainer(strategy=...)` is
      typed `str | Strategy`, so jsonargparse keeps a class name given without init args as a plain string, which
      Lightning then rejects as an unknown registered name; such a string is turned into `class_path` form when it
      names a `Strategy` subclass (by class name or import path).
    """

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """With `rich` installed and no progress bar configured, `DparRichProgressBar` instead of Lightning's default
        rich bar, which reads `Epoch 0/-2` and `v_num: 0.000` in a run bounded by `max_steps`."""
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        configured = kwargs.get("callbacks", config.get("trainer.callbacks"))  # a list, one callback, or None
        callbacks = list(configured) if isinstance(configured, (list, tuple)) else [configured] if configured else []
        if (
            importlib.util.find_spec("rich") is not None
            and config.get("trainer.enable_progress_bar") is not False
            and not any(isinstance(callback, ProgressBar) for callback in callbacks)
        ):
            from lightning_dpar.progress import DparRichProgressBar

            kwargs["callbacks"] = [*callbacks, DparRichProgressBar()]
        return super().instantiate_trainer(**kwargs)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        strategy = config.get("trainer.strategy")
        if strategy == "auto":
            config["trainer.strategy"] = default_strategy(configured_world_size(config))
        elif isinstance(strategy, str):
            class_path = strategy_class_path(strategy)
            if class_path is not None:
                config["trainer.strategy"] = Namespace(class_path=class_path, init_args=Namespace())


def default_strategy(world_size: int | None) -> Namespace:
    """`DEFAULT_STRATEGY`, with tensor parallelism left out (said on rank 0) when TP 2 does not divide `world_size`,
    so that the main job's first command trains on one device, or three, instead of failing in setup."""
    strategy = DEFAULT_STRATEGY.clone()
    tp = strategy.init_args.tensor_parallel_size
    if world_size is not None and world_size % tp:
        strategy.init_args.tensor_parallel_size = 1
        rank_zero_info(
            f"`trainer.strategy: auto` on {world_size} device{'s' if world_size > 1 else ''}: FSDP alone"
            f" (FSDPTensorParallelStrategy(tensor_parallel_size=1)); tensor parallelism {tp} needs a device count it"
            " divides. Choose any layout with `--trainer.strategy=...` (`python -m lightning_dpar plan --auto`"
            " ranks them)."
        )
    return strategy


def configured_world_size(config: Namespace) -> int | None:
    """The number of processes a parsed config's Trainer will start (`devices` x `num_nodes`), as Lightning counts
    them; None where it cannot be told before the Trainer exists (an accelerator other than the CPU or CUDA)."""
    devices, accelerator = config.get("trainer.devices", "auto"), config.get("trainer.accelerator", "auto")
    nodes = config.get("trainer.num_nodes", 1)
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, str) and "," in devices:
        devices = [d for d in devices.split(",") if d.strip()]
    if isinstance(devices, (list, tuple)):
        count: int | None = len(devices)
    elif isinstance(devices, int) and devices > 0:
        count = devices
    elif devices in ("auto", -1):  # every device of the accelerator
        cuda = torch.cuda.device_count()
        count = {"cpu": 1, "gpu": cuda, "cuda": cuda, "auto": cuda or 1}.get(str(accelerator)) or None
    else:
        count = None
    return count * nodes if count is not None and isinstance(nodes, int) else None


def _all_subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_all_subclasses(sub)]
    return found


def strategy_class_path(name: str) -> str | None:
    """Import path of the `Strategy` subclass called `name` (a class name or a dotted path); `None` if none is.

    Registered names (`"dpar_2d"`, `"ddp"`) are left to Lightning's registry; a class name that two imported classes
    share is an error, since picking one silently could train with the wrong strategy.
    """
    if name.lower() in _registered_names():
        return None
    if "." in name:
        module_name, _, attr = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), attr, None)
        except ImportError:
            return None
        return name if isinstance(cls, type) and issubclass(cls, Strategy) else None
    matches = sorted({f"{c.__module__}.{c.__qualname__}" for c in _all_subclasses(Strategy) if c.__qualname__ == name})
    if len(matches) > 1:
        raise ValueError(
            f"`trainer.strategy={name!r}` names several strategy classes: {matches}. Give the full import path."
        )
    if not matches:
        return None
    # The public path (`lightning_dpar.FSDPTensorParallelStrategy`) reads better in a saved config.
    return f"lightning_dpar.{name}" if getattr(lightning_dpar, name, None) is not None else matches[0]


def _registered_names() -> set[str]:
    from lightning.pytorch.strategies import StrategyRegistry

    return set(StrategyRegistry.available_strategies())


class _MetaModelCLI(DparCLI):
    """Builds the model (and datamodule) on the meta device: no memory, for the `plan` dry-run."""

    def instantiate_classes(self) -> None:
        with torch.device("meta"):
            super().instantiate_classes()


def cli_main(args: list[str] | None = None, run: bool = True, model_on_meta: bool = False) -> DparCLI:
    """Build the CLI from `args` (without the program name).

    With `run=True`, `args` starts with a subcommand (`["fit", "--config", f]`) and the CLI runs it; with
    `run=False` there is no subcommand and only the configured objects are built (tests, the `plan` dry-run);
    `model_on_meta=True` builds them on the meta device.
    """
    defaults = {"default_config_files": [str(DEFAULT_CONFIG)]}
    return (_MetaModelCLI if model_on_meta else DparCLI)(
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_kwargs={sub: defaults for sub in TRAINER_SUBCOMMANDS} if run else defaults,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )
