"""Which of the package's modules one setup pass runs code in: `python -m benchmarks.setup_pass`.

A real `Trainer(devices=1)` on a one-rank gloo group fits a 2-block model for one step under `dpar_fsdp` and
`dpar_2d` (a TP plan on a mesh whose tensor-parallel dim has size 1); a profile hook records every package module
a Python function of which is called from the start of `setup_environment` to the end of `setup` (the pass from
model to parallel model), and the script prints them grouped by folder. docs/architecture.md's walk through the
pass is this list read in order; a pass that starts touching more folders is a design smell worth a look. It also
counts the calls of the functions that compute the plan's facts (`FACTS`): each should run once per pass.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch import nn

import lightning_dpar

PACKAGE_ROOT = Path(lightning_dpar.__file__).parent
#: Functions computing a fact of the plan, counted per pass (the names they had before and after issue 33).
FACTS = ("plan_modules", "data_parallel_roots", "tied_parameters", "initialisers", "build_device_mesh", "build")


class _Blocks(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

    def training_step(self, batch, batch_idx):
        return self.model(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _module_name(filename: str) -> str | None:
    path = Path(filename)
    if PACKAGE_ROOT not in path.parents:
        return None
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_touched(strategy: str) -> tuple[list[str], dict[str, int]]:
    """The package modules whose functions ran during `strategy`'s setup pass, in first-call order, and how often
    each of `FACTS` ran."""
    touched: dict[str, None] = {}
    facts: dict[str, int] = defaultdict(int)
    active = False

    def profile(frame, event, arg):
        nonlocal active
        if event != "call":
            return
        code = frame.f_code
        if code.co_name == "setup_environment" and _module_name(code.co_filename):
            active = True
        if active:
            name = _module_name(code.co_filename)
            if name is not None:
                touched.setdefault(name)
                if code.co_name in FACTS:
                    facts[f"{name.rpartition('.')[2]}.{code.co_name}"] += 1

    class _StopAfterSetup(L.Callback):
        def setup(self, trainer, pl_module, stage):  # Lightning calls callbacks' setup before the strategy's
            pass

        def on_fit_start(self, trainer, pl_module):  # right after `strategy.setup`
            nonlocal active
            active = False

    data = torch.utils.data.TensorDataset(torch.randn(8, 8))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_StopAfterSetup()],
    )
    sys.setprofile(profile)
    try:
        trainer.fit(_Blocks(), torch.utils.data.DataLoader(data, batch_size=4))
    finally:
        sys.setprofile(None)
    return list(touched), dict(facts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", action="append", help="strategy names (default: dpar_fsdp and dpar_2d)")
    args = parser.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    for strategy in args.strategy or ["dpar_fsdp", "dpar_2d"]:
        touched, facts = modules_touched(strategy)
        folders: dict[str, list[str]] = defaultdict(list)
        for name in touched:
            folder, _, rest = name.removeprefix("lightning_dpar.").partition(".")
            folders[folder if rest else "(top level)"].append(rest or folder)
        print(f"{strategy}: {len(touched)} modules in {len(folders)} folders")
        for folder, names in folders.items():
            print(f"  {folder}: {', '.join(names)}")
        print(f"  calls: {', '.join(f'{name} x{count}' for name, count in sorted(facts.items()))}")


if __name__ == "__main__":
    main()
