"""`python -m lightning_dpar COMMAND ...`

- `fit | validate | test | predict`: LightningCLI (see `lightning_dpar.cli`); with no other argument, `fit` trains
  the bundled GPT example on 4 CPU processes with `dpar_2d`.
- `plan`: print the mesh, the per-module plan, every parameter's placement and per-rank memory, without launching
  processes or allocating the model (see `lightning_dpar.estimates`).
- `plan --auto`: rank every valid layout by estimated step time among those that fit (see
`lightning_dpar.layout_search`).
- `calibrate`: measure this machine into a hardware profile for `plan --auto` (see
`lightning_dpar.layout_search.calibrate`).
- `consolidate`: turn a sharded checkpoint into a single file (see `lightning_dpar.checkpoint.consolidate`).
"""

from __future__ import annotations

import sys

__all__ = [
    "main",
]

USAGE = """usage: python -m lightning_dpar {fit,validate,test,predict,plan,calibrate,consolidate} [ARGS...]

  fit|validate|test|predict   LightningCLI; defaults train the bundled GPT example (4 CPU processes, TP 2 x FSDP 2).
                              Add --config FILE.yaml, --trainer.strategy=NAME, --ckpt_path last, --help, ...
  plan                        dry-run: mesh, per-module plan, parameter placement and per-rank memory, without
                              launching processes or allocating the model (--help for options).
  plan --auto                 rank every valid layout by estimated step time and memory (--profile, --batch-size,
                              --device-memory; see docs/auto-layout.md).
  calibrate                   measure matmul throughput and collectives by group size -> profile JSON (--out).
  consolidate                 sharded checkpoint -> single file (--help for options).
"""


def main(argv: list[str] | None = None) -> int:
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command in ("fit", "validate", "test", "predict"):
        from lightning_dpar.cli import cli_main

        cli_main(None if from_command_line else argv)  # None: LightningCLI reads sys.argv itself
        return 0
    if command == "plan" and "--auto" in rest:
        from lightning_dpar.layout_search.cli import main as auto_main

        return auto_main(rest)
    if command == "plan":
        from lightning_dpar.estimates import main as plan_main

        return plan_main(rest)
    if command == "calibrate":
        from lightning_dpar.layout_search.calibrate import main as calibrate_main

        return calibrate_main(rest)
    if command == "consolidate":
        from lightning_dpar.checkpoint.consolidate import main as consolidate_main

        return consolidate_main(rest)
    print(f"Unknown command {command!r}.\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
