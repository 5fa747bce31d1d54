"""The layout search where a process group exists already: in a fresh Python process.

The search plans each candidate mesh with the dry run, on a fake process group of N ranks, which torch can only
create in a process without a default group. A second `dpar_auto` Trainer in a process whose first Trainer started
the real group (or a `Trainer` in a process that started one itself) would fail there. And a process about to train
should not host the fake worlds at all: the device meshes they build leave process-group names behind, and a later
real mesh's DTensors can resolve to groups that no longer exist (seen on 4 gloo ranks: "Could not resolve the process
group registered under the name 3" when gathering a 2-D state dict). `AutoParallelStrategy` therefore always searches
in a child (`in_child=True`); `search_anywhere` runs the same search there
(`python -m lightning_dpar.layout_search.isolated IN OUT`): the model goes over as its meta copy, the result comes back
pickled. The child costs a Python start and the imports (seconds); the search
and its result are the same as in this process.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lightning_dpar.layout_search.probe import meta_copy, search_model
from lightning_dpar.layout_search.search import SearchResult

__all__ = ["search_anywhere"]


def search_anywhere(module: L.LightningModule, *args: Any, in_child: bool = False, **kwargs: Any) -> SearchResult:
    """`search_model(module, *args, **kwargs)`, in this process when it has no process group and `in_child` is
    false, else in a child process."""
    if not in_child and not dist.is_initialized():
        return search_model(module, *args, **kwargs)
    with tempfile.TemporaryDirectory(prefix="dpar-layout-") as directory:
        request, answer = Path(directory) / "request.pt", Path(directory) / "answer.pkl"
        torch.save({"module": meta_copy(module), "args": args, "kwargs": kwargs}, request)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
            env.pop(name, None)  # the child is no rank of this world
        done = subprocess.run(
            [sys.executable, "-m", "lightning_dpar.layout_search.isolated", str(request), str(answer)],
            env=env,
            capture_output=True,
            text=True,
        )
        if done.returncode:
            raise RuntimeError(f"The layout search in a child process failed:\n{done.stderr[-4000:]}")
        kind, value = pickle.loads(answer.read_bytes())
    if kind == "error":
        raise ValueError(value)
    return value


def _main(request: str, answer: str) -> None:
    given = torch.load(request, weights_only=False)
    try:
        outcome: tuple[str, Any] = ("result", search_model(given["module"], *given["args"], **given["kwargs"]))
    except (ValueError, TypeError) as err:
        outcome = ("error", str(err))
    Path(answer).write_bytes(pickle.dumps(outcome))


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
