"""Entry point of the multi-process test workers: `torchrun --nproc-per-node N run.py GROUPS OUT_JSON`.

One launch runs several groups of cases (Lightning's import and process start dominate the cost of a case); rank 0
writes every case's result to OUT_JSON for pytest to assert on.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
warnings.filterwarnings("ignore")

import torch.distributed as dist  # noqa: E402

import lightning_dpar  # noqa: E402,F401
from tests.workers import (  # noqa: E402
    checkpoint,
    cli_configs,
    errors,
    features,
    hf,
    lit_gpt_models,
    ordinary,
    parity,
    perf,
    precision,
)

GROUPS = {
    **parity.GROUPS,
    **features.GROUPS,
    **errors.GROUPS,
    **precision.GROUPS,
    **checkpoint.GROUPS,
    **perf.GROUPS,
    **cli_configs.GROUPS,
    **ordinary.GROUPS,
    **hf.GROUPS,
    **lit_gpt_models.GROUPS,
}

if __name__ == "__main__":
    groups, out = sys.argv[1], sys.argv[2]
    results: dict = {}
    for name in groups.split(","):
        GROUPS[name](results)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
