"""Trains with Lightning's own launchers (no torchrun): `python launch_script.py OUT_JSON` re-launches itself per
rank (the "popen" way); `python -i launch_script.py OUT_JSON < /dev/null` is an interactive session, where the
strategy must fork the ranks instead and hand the trained weights back to this process.

`python launch_script.py OUT_JSON NUM_NODES` with `SLURM_*` variables set is one task of a SLURM job (`srun`
started every rank; Lightning's `SLURMEnvironment` supplies the ranks), trained with HSDP: one replica per node.
Under torchrun, `python launch_script.py OUT_JSON 1 user_group` starts the process group itself before `fit`.

After `fit` and `validate` every rank starts an async checkpoint save and exits without waiting for it; the last
exit hook writes `OUT_JSON.exit<rank>`: whether a process group or one of the strategy's threads was still alive
(the strategy must end what it started before the interpreter shuts down, and only that)."""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading

EXIT_STATE: dict = {}


def _record_exit_state() -> None:
    """Registered before anything else, so it runs after every other exit hook (they run last-in, first-out)."""
    import torch.distributed as dist

    if "rank" not in EXIT_STATE:  # the interactive parent process, which takes no part in the run
        return
    EXIT_STATE["process_group_alive"] = dist.is_initialized()
    EXIT_STATE["threads"] = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
    if dist.is_initialized():
        dist.destroy_process_group()  # a group this script created: its own to end
    with open(f"{sys.argv[1]}.exit{EXIT_STATE['rank']}", "w") as f:
        json.dump(EXIT_STATE, f)


atexit.register(_record_exit_state)  # before any import that could register a hook of its own
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import lightning as L  # noqa: E402

import lightning_dpar  # noqa: E402, F401
from lightning_dpar._private_api import IS_INTERACTIVE  # noqa: E402
from tests.support.models import ParityModule, RegressionData, global_batches, loader, reference_train  # noqa: E402

WORLD, BATCH, STEPS = 2, 4, 3

if __name__ == "__main__":
    out = sys.argv[1]
    num_nodes = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    if sys.argv[3:] == ["user_group"]:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    data = RegressionData()
    module = ParityModule()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD // num_nodes,
        num_nodes=num_nodes,
        strategy="dpar_hsdp" if num_nodes > 1 else "dpar_fsdp",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader(data, BATCH))
    # Interactive: this is the parent process, holding the weights the ranks sent back. Popen: rank 0 holds its
    # FSDP shards, so gather them (all ranks take part).
    mesh = None  # the interactive parent process takes no part in the mesh
    if IS_INTERACTIVE:
        got = module.state_dict()
    else:
        mesh = dict(zip(trainer.strategy.device_mesh.mesh_dim_names, trainer.strategy.device_mesh.shape))
        from tests.workers.common import full_params

        got = full_params(trainer)
    if not IS_INTERACTIVE:
        trainer.validate(module, loader(data, BATCH), verbose=False)
        EXIT_STATE["rank"] = trainer.global_rank
        trainer.strategy.async_save = True
        trainer.save_checkpoint(os.path.join(os.path.dirname(out), "after_fit.ckpt"))  # still writing at exit
    if trainer.global_rank == 0:
        want = reference_train("sgd", global_batches(data, WORLD, BATCH, STEPS))
        with open(out, "w") as f:
            json.dump(
                {
                    "interactive": IS_INTERACTIVE,
                    "launcher": type(trainer.strategy.launcher).__name__,
                    "environment": type(trainer.strategy.cluster_environment).__name__,
                    "mesh": mesh,
                    "max_abs_diff": max((got[k] - want[k]).abs().max().item() for k in want),
                },
                f,
            )
