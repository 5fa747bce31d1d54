"""Loading hostile and damaged checkpoints through real Trainers on 2 ranks, and memory-mapped full-format loads.

Every case runs `fit(ckpt_path=...)` on every rank and records the error each rank got and whether the payload ran
(it would create a marker file); a control run shows each payload does run when unpickled without our reader.
"""

from __future__ import annotations

import ctypes
import gc
import io
import os
import pickle
import shutil

import lightning as L
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.utils.data import DataLoader, TensorDataset

from lightning_dpar import FullyShardStrategy
from lightning_dpar.checkpoint.full import read_full
from lightning_dpar.checkpoint.safe_io import SafeLoadPlanner, safe_storage_reader, translate_dcp_errors
from lightning_dpar.checkpoint.storage import Location
from tests import malicious
from tests.workers.checkpoint import ResumeModule, gather, train_loader, val_loader, workdir
from tests.workers.common import full_params, trainer_for


def error_of_any(fn) -> str | None:
    """The error `fn` raised, whatever its base class (DCP's `CheckpointException` is a `BaseException`)."""
    try:
        fn()
    except BaseException as err:  # the test asserts which one it is
        return f"{type(err).__name__}: {' '.join(str(err).split())}"
    return None


def fit_from(path) -> str | None:
    """`fit(ckpt_path=path)` on every rank; the error it raised."""
    trainer = trainer_for(FullyShardStrategy(), max_steps=3)
    return error_of_any(lambda: trainer.fit(ResumeModule(), train_loader(), ckpt_path=str(path)))


def _control(marker, run) -> bool:
    """Rank 0 unpickles the payload without our reader: it must create the marker (then removed)."""
    if dist.get_rank() != 0:
        return True
    try:
        run()
    except BaseException:  # what the payload returns is no checkpoint
        pass
    works = marker.exists()
    marker.unlink(missing_ok=True)
    return works


def group_fit(results):
    root = workdir() / "safety"
    marker = root / "PAYLOAD_RAN"
    trainer = trainer_for(FullyShardStrategy(), max_steps=2)
    trainer.fit(ResumeModule(), train_loader())
    good = root / "good.ckpt"
    trainer.save_checkpoint(good)
    full_trainer = trainer_for(FullyShardStrategy(checkpoint_format="full"))
    full_trainer.validate(ResumeModule(), val_loader(), ckpt_path=str(good), verbose=False)
    full_trainer.save_checkpoint(root / "good_full.ckpt")
    hostile = root / "hostile"
    index_payloads = malicious.index_payloads(marker, root)
    paths, controls = {}, {}
    if dist.get_rank() == 0:
        for case in ("index_dotted", "index_function", "meta_pt", "distcp_leaf", "distcp_tensor"):
            paths[case] = hostile / f"{case}.ckpt"
            shutil.copytree(good, paths[case])
        index_dotted = index_payloads["dotted_filesystem_os_system"]
        index_function = index_payloads["function_of_dcp_module"]
        (paths["index_dotted"] / ".metadata").write_bytes(index_dotted)
        (paths["index_function"] / ".metadata").write_bytes(index_function)
        runs_command = malicious.saved(malicious.RunsCommand(malicious.shell(marker)))
        (paths["meta_pt"] / "meta.pt").write_bytes(runs_command)
        _, leaf_file = malicious.poison_item(paths["distcp_leaf"], runs_command)
        _, tensor_file = malicious.poison_item(paths["distcp_tensor"], runs_command, tensor=True)
        paths["full_file"] = hostile / "full_file.ckpt"
        paths["full_file"].write_bytes(malicious.saved(malicious.Evaluates(malicious.shell(marker))))
        index_globals = sorted(malicious.globals_named((good / ".metadata").read_bytes()))
        controls = {
            "index_dotted": _control(marker, lambda: pickle.loads(index_dotted)),
            "index_function": _control(marker, lambda: pickle.loads(index_function)),
            **{
                case: _control(marker, lambda: torch.load(io.BytesIO(runs_command), weights_only=False))
                for case in ("meta_pt", "distcp_leaf", "distcp_tensor")
            },
            "full_file": _control(marker, lambda: torch.load(paths["full_file"], weights_only=False)),
        }
    paths = gather(paths)[0]
    cases = {}
    for case, path in paths.items():
        dist.barrier()
        error = fit_from(path)
        dist.barrier()
        cases[case] = {"path": str(path), "error": error, "ran": marker.exists()}
    # The helper the load paths wrap `dcp.load` in, on the collective read of the poisoned tensor.
    location = Location.parse(paths["distcp_tensor"])
    state = {"state_dict": get_model_state_dict(trainer.strategy.model)}

    def read_tensor_item() -> None:
        with translate_dcp_errors(location):
            dcp.load(state, storage_reader=safe_storage_reader(location), planner=SafeLoadPlanner())

    translated = error_of_any(read_tensor_item)
    translated_ran = marker.exists()
    # Damaged checkpoints, each in a directory with a complete earlier one.
    damaged = {}
    for case in ("truncated_meta", "missing_shard"):
        directory = root / case
        previous, victim = directory / "previous.ckpt", directory / "victim.ckpt"
        if dist.get_rank() == 0:
            shutil.copytree(good, previous)
            os.utime(previous / "meta.pt", (1, 1))
            shutil.copytree(good, victim)
            if case == "truncated_meta":
                data = (victim / "meta.pt").read_bytes()
                (victim / "meta.pt").write_bytes(data[: len(data) // 2])
            else:
                (victim / "__1_0.distcp").unlink()
        dist.barrier()
        damaged[case] = {"previous": str(previous), "error": fit_from(victim)}
    per_rank = gather({"cases": cases, "damaged": damaged, "translated": (translated, translated_ran)})
    if dist.get_rank() == 0:
        out = {}
        for case in paths:
            out[case] = {
                "path": paths[case].as_posix(),
                "payload_works": controls[case],
                "errors": [r["cases"][case]["error"] for r in per_rank],
                "ran": [r["cases"][case]["ran"] for r in per_rank],
            }
        out["index_globals"] = index_globals
        out["distcp_leaf"]["data_file"] = leaf_file
        out["distcp_tensor"]["data_file"] = tensor_file
        out["translated"] = {
            "data_file": tensor_file,
            "path": paths["distcp_tensor"].as_posix(),
            "errors": [r["translated"][0] for r in per_rank],
            "ran": [r["translated"][1] for r in per_rank],
        }
        for case in damaged:
            out[case] = {
                "previous": damaged[case]["previous"],
                "errors": [r["damaged"][case]["error"] for r in per_rank],
            }
        results["safety_fit"] = out


# ---------------------------------------------------------------------- memory-mapped full-format loads
class Wide(L.LightningModule):
    """64 MiB of weights in 16 tensors of 4 MiB."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(16)))

    def training_step(self, batch, batch_idx):
        return self.body(batch[0]).square().mean()

    def validation_step(self, batch, batch_idx):
        self.log("val", self.body(batch[0]).square().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def _peak_growth(fn) -> float:
    """Growth of this process's peak RSS (VmHWM) while `fn` runs, in MiB. Freed heap memory is returned to the OS
    first (`malloc_trim`), so an allocation cannot hide in pages the process already holds."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _status_mib("VmRSS")
    fn()
    return _status_mib("VmHWM") - before


class MeasuredLoad(FullyShardStrategy):
    """Records the peak RSS growth of the strategy's own checkpoint load (the real one, measured around it)."""

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        loaded = {}
        load = super().load_checkpoint
        self.load_growth_mib = _peak_growth(lambda: loaded.update(load(checkpoint_path, weights_only)))
        return loaded


def group_mmap(results):
    root = workdir() / "mmap"
    data = DataLoader(TensorDataset(torch.randn(8, 1024)), batch_size=2)
    trainer = trainer_for(FullyShardStrategy(checkpoint_format="full"), max_steps=1)
    trainer.fit(Wide(), data)
    file = root / "wide.ckpt"
    trainer.save_checkpoint(file)
    reference = full_params(trainer)
    strategy = MeasuredLoad(checkpoint_format="full")
    evaluator = trainer_for(strategy)
    evaluator.validate(Wide(), data, ckpt_path=str(file), verbose=False)
    loaded = full_params(evaluator)
    unmapped = _peak_growth(lambda: torch.load(file, map_location="cpu", weights_only=True))
    read = _peak_growth(lambda: read_full(Location.parse(file)))
    per_rank = gather({"load": strategy.load_growth_mib, "unmapped": unmapped, "read": read})
    if dist.get_rank() == 0:
        results["safety_mmap"] = {
            "file_mib": file.stat().st_size / 2**20,
            "load_growth_mib": [r["load"] for r in per_rank],
            "unmapped_growth_mib": [r["unmapped"] for r in per_rank],
            "read_growth_mib": [r["read"] for r in per_rank],
            "max_diff": max((loaded[k] - reference[k]).abs().max().item() for k in reference),
        }


GROUPS = {"safety_fit": group_fit, "safety_mmap": group_mmap}
