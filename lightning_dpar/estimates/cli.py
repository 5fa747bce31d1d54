"""`python -m lightning_dpar plan [--world-size N] [--num-nodes M] [--rank R] [--all-params] [--batch-size B
--seq-len T] [CLI args]`: the dry run's command line. The other arguments (`--config FILE`, `--trainer.*`,
`--model.*`, `--data.*`) build the Trainer and the model (on the meta device) as `python -m lightning_dpar fit`
would; `plan` then reports on them. With `--batch-size` and `--seq-len` it also estimates activation memory for
token-id batches of that shape (tracing a training step takes about a third of a second per block, twice); without
them the report names the datamodule's batch shape when it knows it (`StdlibBytes.batch_shape`)."""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any

from lightning_dpar.estimates.dry_run import plan

__all__ = ["configured_run", "main"]


def main(argv: list[str] | None = None) -> int:
    """`python -m lightning_dpar plan [--world-size N] [--num-nodes M] [--rank R] [CLI args such as --config F]`."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_dpar plan",
        description="Print the mesh, per-module plan, parameter placements and per-rank memory of a configuration"
        " without launching processes or allocating the model. Other arguments (--config FILE, --trainer.*,"
        " --model.*) are read as by `python -m lightning_dpar fit`.",
    )
    parser.add_argument("--world-size", type=int, help="ranks to plan for (default: trainer devices x num_nodes)")
    parser.add_argument("--num-nodes", type=int, help="nodes the ranks span (default: trainer num_nodes)")
    parser.add_argument("--rank", type=int, default=0, help="whose shards to show (default: 0, the largest)")
    parser.add_argument("--all-params", action="store_true", help="one line per parameter (no x N grouping)")
    parser.add_argument(
        "--batch-size", type=int, help="samples per data-parallel rank and step, for the activation estimate"
    )
    parser.add_argument("--seq-len", type=int, help="token ids per sample (the batch training_step receives)")
    args, cli_args = parser.parse_known_args(argv)
    cli, world_size, num_nodes = configured_run(cli_args, args.world_size, args.num_nodes)
    trainer = cli.trainer
    try:
        batch = _batch_shape(args)
        source = "from --batch-size and --seq-len"
        report = plan(trainer.strategy, cli.model, world_size, num_nodes, args.rank, batch, source)
    except (ValueError, TypeError) as err:
        print(f"plan failed: {err}", file=sys.stderr)
        return 1
    shape = getattr(getattr(cli, "datamodule", None), "batch_shape", None)
    if batch is None and isinstance(shape, tuple) and len(shape) == 2:
        report.activation_note += f" (the datamodule's batches: --batch-size {shape[0]} --seq-len {shape[1]})"
    print(report.render(all_params=args.all_params))
    return 0


def configured_run(cli_args: list[str], world_size: int | None, num_nodes: int | None) -> tuple[Any, int, int]:
    """What `python -m lightning_dpar fit` would build from `cli_args` (the LightningCLI, with the model on the meta
    device), and the world to plan for: `world_size` ranks on `num_nodes` nodes, by default the Trainer's."""
    from lightning_dpar.cli import cli_main

    with warnings.catch_warnings():
        # Expected: the CLI is given the dry run's leftover arguments rather than sys.argv.
        warnings.filterwarnings("ignore", message=".*args parameter is intended.*")
        cli = cli_main(cli_args, run=False, model_on_meta=True)
    nodes = num_nodes or cli.trainer.num_nodes
    return cli, world_size or cli.trainer.num_devices * nodes, nodes


def _batch_shape(args: argparse.Namespace) -> tuple[int, int] | None:
    """The token-id batch shape each data-parallel rank's `training_step` receives, when given."""
    given = (args.batch_size, args.seq_len)
    if given == (None, None):
        return None
    if None in given or min(given) < 1:  # type: ignore[type-var]
        raise ValueError(f"give both --batch-size and --seq-len, as positive integers (got {given})")
    return (args.batch_size, args.seq_len)
