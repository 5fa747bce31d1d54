"""`python -m lightning_dpar plan [--world-size N] [--num-nodes M] [--rank R] [--all-params] [CLI args]`: the dry
run's command line. The other arguments (`--config FILE`, `--trainer.*`, `--model.*`) build the Trainer and the
model (on the meta device) as `python -m lightning_dpar fit` would; `plan` then reports on them."""

from __future__ import annotations

import argparse
import sys
import warnings

from lightning_dpar.dry_run.engine import plan

__all__ = ["main"]


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
    args, cli_args = parser.parse_known_args(argv)
    from lightning_dpar.cli import cli_main

    with warnings.catch_warnings():
        # Expected: the CLI is given `plan`'s leftover arguments rather than sys.argv.
        warnings.filterwarnings("ignore", message=".*args parameter is intended.*")
        cli = cli_main(cli_args, run=False, model_on_meta=True)
    trainer = cli.trainer
    num_nodes = args.num_nodes or trainer.num_nodes
    world_size = args.world_size or trainer.num_devices * num_nodes
    try:
        report = plan(trainer.strategy, cli.model, world_size, num_nodes, args.rank)
    except (ValueError, TypeError) as err:
        print(f"plan failed: {err}", file=sys.stderr)
        return 1
    print(report.render(all_params=args.all_params))
    return 0
