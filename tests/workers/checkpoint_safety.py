"""Loading hostile and damaged checkpoints through real Trainers on 2 ranks, and memory-mapped full-format loads.

Every case runs `fit(ckpt_path=...)` on every rank and records the error each rank got and whether the payload ran
(it would create a marker file); a control run shows each payload does run when unpickled without our reader.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import io
import os
import pickle
import shutil
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.utils.data import DataLoader, TensorDataset

from lightning_dpar import FullyShardStrategy
from lightning_dpar.checkpoint.full import read_full
from lightning_dpar.checkpoint.safe_io import SafeLoadPlanner, safe_storage_reader, translate_dcp_errors
from lightning_dpar.checkpoint.storage import Location
from tests.support import malicious
from tests.workers.cases import Case
from tests.workers.checkpoint_common import ResumeModule, case_dir, gather, train_loader
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


@functools.cache
def _good() -> tuple[L.Trainer, Path]:
    """A 2-step `dpar_fsdp` training and the sharded checkpoint it saved (`good.ckpt`)."""
    trainer = trainer_for(FullyShardStrategy(), max_steps=2)
    trainer.fit(ResumeModule(), train_loader())
    good = case_dir("safety_good") / "good.ckpt"
    trainer.save_checkpoint(good)
    return trainer, good


def _hostile(case: str, good: Path, marker: Path, work: Path) -> tuple[Path, bool, str | None]:
    """Rank 0 writes the hostile checkpoint `case` (a copy of `good` with one file replaced or poisoned); returns
    its path, whether its payload runs when unpickled without our reader, and the data file of a poisoned item."""
    path = work / f"{case}.ckpt"
    runs_command = malicious.saved(malicious.RunsCommand(malicious.shell(marker)))
    data_file = None
    if case == "full_file":
        path.write_bytes(malicious.saved(malicious.Evaluates(malicious.shell(marker))))
        return path, _control(marker, lambda: torch.load(path, weights_only=False)), None
    shutil.copytree(good, path, dirs_exist_ok=True)
    if case.startswith("index_"):
        kind = {"index_dotted": "dotted_filesystem_os_system", "index_function": "function_of_dcp_module"}[case]
        payload = malicious.index_payloads(marker, work)[kind]
        (path / ".metadata").write_bytes(payload)
        return path, _control(marker, lambda: pickle.loads(payload)), None
    if case == "meta_pt":
        (path / "meta.pt").write_bytes(runs_command)
    else:
        _, data_file = malicious.poison_item(path, runs_command, tensor=case == "distcp_tensor")
    return path, _control(marker, lambda: torch.load(io.BytesIO(runs_command), weights_only=False)), data_file


def hostile_case(case: str) -> dict:
    """`fit(ckpt_path=...)` on every rank from the hostile checkpoint `case`: each rank's error, and whether the
    payload ran (its marker file appeared)."""
    _, good = _good()
    work = case_dir(f"safety_{case}")
    marker = work / "PAYLOAD_RAN"
    made = None
    if dist.get_rank() == 0:
        work.mkdir(parents=True, exist_ok=True)
        made = _hostile(case, good, marker, work)
    path, payload_works, data_file = gather(made)[0]
    error = fit_from(path)
    dist.barrier()
    per_rank = gather((error, marker.exists()))
    result = {
        "path": Path(path).as_posix(),
        "payload_works": payload_works,
        "errors": [error for error, _ in per_rank],
        "ran": [ran for _, ran in per_rank],
    }
    return result if data_file is None else {**result, "data_file": data_file}


def index_globals_case() -> list:
    """Every global the index of the 2-rank FSDP checkpoint (DTensor shards, Adam state, LR scheduler) refers to."""
    _, good = _good()
    return sorted(malicious.globals_named((good / ".metadata").read_bytes()))


def translated_case() -> dict:
    """The helper the load paths wrap `dcp.load` in, on the collective read of a poisoned tensor item."""
    trainer, good = _good()
    work = case_dir("safety_translated")
    marker = work / "PAYLOAD_RAN"
    made = None
    if dist.get_rank() == 0:
        work.mkdir(parents=True, exist_ok=True)
        made = _hostile("distcp_tensor", good, marker, work)
    path, _, data_file = gather(made)[0]
    location = Location.parse(path)
    state = {"state_dict": get_model_state_dict(trainer.strategy.model)}

    def read_tensor_item() -> None:
        with translate_dcp_errors(location):
            dcp.load(state, storage_reader=safe_storage_reader(location), planner=SafeLoadPlanner())

    per_rank = gather((error_of_any(read_tensor_item), marker.exists()))
    return {
        "data_file": data_file,
        "path": Path(path).as_posix(),
        "errors": [error for error, _ in per_rank],
        "ran": [ran for _, ran in per_rank],
    }


def damaged_case(case: str) -> dict:
    """A damaged checkpoint (`case`) in a directory with a complete earlier one: each rank's error."""
    _, good = _good()
    directory = case_dir(f"safety_{case}")
    previous, victim = directory / "previous.ckpt", directory / "victim.ckpt"
    if dist.get_rank() == 0:
        shutil.copytree(good, previous, dirs_exist_ok=True)
        os.utime(previous / "meta.pt", (1, 1))
        shutil.copytree(good, victim, dirs_exist_ok=True)
        if case == "truncated_meta":
            data = (victim / "meta.pt").read_bytes()
            (victim / "meta.pt").write_bytes(data[: len(data) // 2])
        else:
            (victim / "__1_0.distcp").unlink()
    dist.barrier()
    return {"previous": str(previous), "errors": gather(fit_from(victim))}


HOSTILE = ("index_dotted", "index_function", "meta_pt", "distcp_leaf", "distcp_tensor", "full_file")


def group_fit() -> Iterator[Case]:
    for case in HOSTILE:
        yield Case(f"safety_{case}", lambda case=case: hostile_case(case))
    yield Case("safety_index_globals", index_globals_case)
    yield Case("safety_translated", translated_case)
    for case in ("truncated_meta", "missing_shard"):
        yield Case(f"safety_{case}", lambda case=case: damaged_case(case))


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


def mmap_case() -> dict:
    root = case_dir("safety_mmap")
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
    if dist.get_rank() != 0:
        return None
    return {
        "file_mib": file.stat().st_size / 2**20,
        "load_growth_mib": [r["load"] for r in per_rank],
        "unmapped_growth_mib": [r["unmapped"] for r in per_rank],
        "read_growth_mib": [r["read"] for r in per_rank],
        "max_diff": max((loaded[k] - reference[k]).abs().max().item() for k in reference),
    }


class AdamWide(Wide):
    """`Wide` trained with Adam: a full-format checkpoint then holds the weights and twice as much optimizer state."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def mmap_resume_case() -> dict:
    """Peak RSS growth of each rank's load when `fit` resumes from a full-format file with Adam state."""
    root = case_dir("safety_mmap_resume")
    data = DataLoader(TensorDataset(torch.randn(8, 1024)), batch_size=2)
    trainer = trainer_for(FullyShardStrategy(checkpoint_format="full"), max_steps=1)
    trainer.fit(AdamWide(), data)
    file = root / "wide_adam.ckpt"
    trainer.save_checkpoint(file)
    reference = {**full_params(trainer), **{f"optimizer.{k}": v for k, v in _full_optimizer(trainer).items()}}
    strategy = MeasuredLoad(checkpoint_format="full")
    resumed = trainer_for(strategy, max_steps=1)  # loads, then stops: `max_steps` is reached already
    resumed.fit(AdamWide(), data, ckpt_path=str(file))
    loaded = {**full_params(resumed), **{f"optimizer.{k}": v for k, v in _full_optimizer(resumed).items()}}
    per_rank = gather(strategy.load_growth_mib)
    if dist.get_rank() != 0:
        return None
    return {
        "file_mib": file.stat().st_size / 2**20,
        "load_growth_mib": per_rank,
        "max_diff": max((loaded[k] - reference[k]).abs().max().item() for k in reference),
    }


def _full_optimizer(trainer) -> dict[str, torch.Tensor]:
    """The optimizer's state tensors, gathered (on rank 0), by parameter name and state name."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_optimizer_state_dict(trainer.lightning_module, trainer.optimizers[0], options=options)
    return {f"{fqn}.{key}": v for fqn, values in state.get("state", {}).items() for key, v in values.items()}


GROUPS = {
    "safety_fit": group_fit,
    "safety_mmap": lambda: [Case("safety_mmap", mmap_case), Case("safety_mmap_resume", mmap_resume_case)],
}
