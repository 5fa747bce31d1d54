"""`python -m lightning_dpar plan --auto [--profile P] [--device-memory GIB] [--batch-size B | --global-batch-size G]
[--seq-len S] [--loss-parallel] [--float8 RECIPE] [--top N] [--world-size N] [--num-nodes M] [CLI args]`: the layout
search's ranked table, without launching anything.

The other arguments (`--config FILE`, `--trainer.*`, `--model.*`, `--data.*`) build the Trainer, the model (on the
meta device) and the data as `python -m lightning_dpar fit` would; the world is the Trainer's devices x nodes, the
precision the Trainer's, the batch per data-parallel rank the data module's `batch_size` (with
`--global-batch-size`, the global batch over each layout's data-parallel ranks). With
`--trainer.strategy=dpar_auto` (or `AutoParallelStrategy` and its arguments) the strategy's own profile, memory and
batch settings are used (its `loss_parallel` and `float8` too), so the table shows the choice training will make;
a configured strategy with `loss_parallel=True` allows loss parallel as `--loss-parallel` does.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lightning_dpar.estimates.cli import configured_run
from lightning_dpar.float8.config import RECIPES
from lightning_dpar.layout_search.batch import BatchRule
from lightning_dpar.layout_search.probe import search_model
from lightning_dpar.layout_search.profiles import GIB, PRESETS, get_profile
from lightning_dpar.layout_search.report import render_search

__all__ = ["main"]

DEFAULT_BATCH_SIZE = 8


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_dpar plan --auto",
        description="Rank every valid layout of the configured model and world by estimated step time among those"
        " that fit the device memory; print memory and time splits and the rejected layouts with reasons.",
    )
    parser.add_argument("--auto", action="store_true", help="(selects this command)")
    parser.add_argument("--world-size", type=int, help="ranks (default: trainer devices x num_nodes)")
    parser.add_argument("--num-nodes", type=int, help="nodes (default: trainer num_nodes)")
    parser.add_argument("--profile", help=f"hardware preset ({', '.join(PRESETS)}) or a calibrated JSON profile")
    parser.add_argument("--device-memory", type=float, help="GiB one rank may use (default: the profile's)")
    parser.add_argument("--batch-size", type=int, help="sequences per data-parallel rank (default: the data's)")
    parser.add_argument(
        "--global-batch-size", type=int, help="sequences per step over all data-parallel ranks (not with --batch-size)"
    )
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's context length)")
    parser.add_argument(
        "--loss-parallel",
        action="store_true",
        default=None,
        help="allow loss parallel: the layouts with tensor parallelism (and no pipeline or context parallelism) keep"
        " the logits sharded over the vocabulary (only for a cross-entropy loss without label smoothing)",
    )
    parser.add_argument(
        "--float8",
        choices=RECIPES,
        help="price every layout training with this torchao float8 recipe (a profile with float8 matmuls)",
    )
    parser.add_argument("--top", type=int, default=20, help="rows of the ranked table to show (default 20)")
    return parser


def _settings(strategy: Any, data: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Profile, memory, batch, sequence length and strategy arguments: the command line's, else the strategy's
    (an `AutoParallelStrategy`), else the data module's and the defaults."""
    own = getattr(strategy, "search_settings", None)
    settings: dict[str, Any] = dict(own) if own is not None else {}
    tp_plan = getattr(strategy, "_tp_plan", None)
    if own is None and tp_plan == "auto":
        settings["strategy_kwargs"] = {"tp_plan": "auto"}
    loss = getattr(strategy, "_context_parallel_loss", "whole")
    if own is None and loss != "whole":  # the CP candidates' head and loss as the configured strategy runs them
        settings["strategy_kwargs"] = {**settings.get("strategy_kwargs", {}), "context_parallel_loss": loss}
    if own is None:  # a configured strategy's loss parallel: its TP candidates run it
        settings["loss_parallel"] = getattr(strategy, "_loss_parallel", False) is True
    if args.loss_parallel:
        settings["loss_parallel"] = True
    if args.float8:
        settings["float8"] = args.float8
    data_batch = getattr(data, "batch_size", None)
    settings["profile"] = args.profile or settings.get("profile") or "cpu-gloo"
    if args.device_memory is not None:
        settings["device_memory"] = int(args.device_memory * GIB)
    global_batch = args.global_batch_size or (None if args.batch_size else settings.get("global_batch_size"))
    if args.batch_size and args.global_batch_size:
        raise ValueError("`--batch-size` and `--global-batch-size` both fix the batch: give one.")
    if global_batch:
        settings["batch_size"] = BatchRule(global_batch=global_batch)
    else:
        settings["batch_size"] = args.batch_size or settings.get("batch_size") or data_batch or DEFAULT_BATCH_SIZE
    settings["seq_len"] = args.seq_len or settings.get("seq_len")
    return settings


def main(argv: list[str] | None = None) -> int:
    args, cli_args = _parser().parse_known_args(argv)
    cli, world_size, num_nodes = configured_run(cli_args, args.world_size, args.num_nodes)
    trainer = cli.trainer
    precision = trainer.strategy.precision_plugin.precision
    try:
        s = _settings(trainer.strategy, cli.datamodule, args)
        profile = get_profile(s["profile"])
        if s.get("device_memory"):
            profile = profile.with_memory(s["device_memory"])
        kwargs = s.get("strategy_kwargs")
        result = search_model(
            cli.model,
            world_size,
            num_nodes,
            profile,
            s["batch_size"],
            s["seq_len"],
            precision,
            kwargs,
            suggest=True,
            loss_parallel=bool(s.get("loss_parallel")),
            float8=s.get("float8"),
            float8_skip=s.get("float8_skip"),
        )
    except (ValueError, TypeError) as err:
        print(f"plan --auto failed: {err}", file=sys.stderr)
        return 1
    print(render_search(result, args.top), end="")
    return 0 if result.best is not None else 1
