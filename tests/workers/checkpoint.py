"""Checkpointing through real Trainers: Lightning's flow (ModelCheckpoint, save/load, ckpt_path="last"), exact
resume, resharding across strategies and world sizes, strict loading, bad input, async save, full format.

Cases that span launches (the resharding chain, the kill test) share the directory of the results file.
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.utils.data import DataLoader

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, ReplicateStrategy
from lightning_dpar.checkpoint import writer as checkpoint_writer
from tests.models import TP_PLAN, Net, ParityModule, RegressionData
from tests.workers.common import BATCH, full_params, trainer_for, world_size


def workdir() -> Path:
    return Path(sys.argv[2]).resolve().parent


class IndexedData(RegressionData):
    def __getitem__(self, i: int):
        return self.x[i], self.y[i], torch.tensor(i)


class ResumeModule(ParityModule):
    """Adam + a per-step LR schedule + per-rank input noise (RNG): resume is exact only if all of it comes back."""

    def __init__(self, hidden: int = 12, extra_layer: bool = False) -> None:
        super().__init__(optimizer="adam")
        torch.manual_seed(0)
        self.model = Net(hidden=hidden)
        if extra_layer:
            self.extra = torch.nn.Linear(5, 5)
        self.losses: list[tuple[int, float]] = []
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        x = x + 0.1 * torch.randn_like(x)
        loss = F.mse_loss(self(x), y)
        self.losses.append((self.global_step, loss.item()))
        self.seen.extend(index.tolist())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def train_loader(sampler=None) -> DataLoader:
    return DataLoader(IndexedData(), batch_size=BATCH, sampler=sampler)


class ReversedSampler(torch.utils.data.Sampler):
    """A custom (non-resumable) sampler: Lightning wraps it in `DistributedSamplerWrapper`."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self) -> int:
        return self.n


def val_loader() -> DataLoader:
    return DataLoader(IndexedData(n=16, seed=7), batch_size=BATCH)


def gather(value):
    values = [None] * world_size()
    dist.all_gather_object(values, value)
    return values


def strategy_for(name: str, **kwargs):
    if name == "fsdp":
        return FullyShardStrategy(**kwargs)
    if name == "replicate":
        return ReplicateStrategy(**kwargs)
    if name == "2d":
        return FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan=TP_PLAN, **kwargs)
    raise ValueError(name)


def full_optimizer(trainer: L.Trainer) -> dict:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(trainer.lightning_module, trainer.optimizers[0], options=options)


def flat_tensors(prefix: str, value) -> dict[str, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in flat_tensors(f"{prefix}.{key}", item).items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in flat_tensors(f"{prefix}.{i}", item).items()}
    return {prefix: torch.tensor(float(value))} if isinstance(value, (int, float)) else {}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if set(a) != set(b):
        return float("inf")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def error_of(fn) -> str | None:
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


# ---------------------------------------------------------------------- Lightning's flow + exact resume
def _resume_case(results: dict, name: str, strategy: str, sampler=None, **strategy_kwargs) -> None:
    """Full run with a checkpoint every 5 steps; resume from step 5 (mid-epoch 0, epoch 1 follows) in a new Trainer."""
    root = workdir() / f"resume_{name}"
    steps = 20  # 16 batches per epoch on 2 data-parallel ranks, 32 on one
    every = ModelCheckpoint(dirpath=root / "every", filename="{step}", every_n_train_steps=5, save_top_k=-1)
    top = ModelCheckpoint(
        dirpath=root / "top",
        filename="{step}",
        every_n_train_steps=5,
        save_top_k=2,
        monitor="val_loss",
        save_last=True,
    )
    full_run = ResumeModule()
    trainer = trainer_for(
        strategy_for(strategy, **strategy_kwargs),
        max_steps=steps,
        callbacks=[every, top],
        val_check_interval=5,
        enable_checkpointing=True,
    )
    trainer.fit(full_run, train_loader(sampler), val_loader())
    val_after_fit = trainer.validate(full_run, val_loader(), verbose=False)[0]["val_loss"]

    resumed = ResumeModule()
    trainer2 = trainer_for(
        strategy_for(strategy), max_steps=steps, val_check_interval=5, callbacks=[], enable_checkpointing=False
    )
    trainer2.fit(resumed, train_loader(sampler), val_loader(), ckpt_path=str(root / "every" / "step=5.ckpt"))

    evaluator = ResumeModule()
    trainer3 = trainer_for(strategy_for(strategy))
    val_from_last = trainer3.validate(evaluator, val_loader(), ckpt_path=str(root / "top" / "last.ckpt"), verbose=False)
    test_error = error_of(lambda: trainer3.validate(evaluator, val_loader(), ckpt_path=str(root / "top" / "nope.ckpt")))

    full_losses, resumed_losses = gather(full_run.losses), gather(resumed.losses)
    if trainer.global_rank == 0:
        results[f"resume_{name}"] = {
            "full_after_5": [[loss for step, loss in losses if step >= 5] for losses in full_losses],
            "resumed": [[loss for _, loss in losses] for losses in resumed_losses],
            "resumed_first_step": min(step for step, _ in resumed_losses[0]),
            "every_dir": sorted(os.listdir(root / "every")),
            "top_dir": sorted(os.listdir(root / "top")),
            "best_k": sorted(Path(p).name for p in top.best_k_models),
            "last_model_path": Path(top.last_model_path).name,
            "val_after_fit": val_after_fit,
            "val_from_last": val_from_last[0]["val_loss"],
            "missing_ckpt_error": test_error,
        }


def group_resume(results):
    _resume_case(results, "fsdp", "fsdp")
    _resume_case(results, "replicate", "replicate")
    _resume_case(results, "2d", "2d")
    _resume_case(results, "fsdp_async", "fsdp", async_save=True)
    _resume_case(results, "fsdp_full", "fsdp", checkpoint_format="full")
    _resume_case(results, "fsdp_custom_sampler", "fsdp", sampler=ReversedSampler(128))


def group_resume_last(results):
    """`fit(ckpt_path="last")` finds `last.ckpt` through ModelCheckpoint and continues from its step."""
    root = workdir() / "resume_last"
    callback = ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=3, save_last=True)
    module = ResumeModule()
    trainer = trainer_for(FullyShardStrategy(), max_steps=6, callbacks=[callback], enable_checkpointing=True)
    trainer.fit(module, train_loader())
    callback2 = ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=3, save_last=True)
    module2 = ResumeModule()
    trainer2 = trainer_for(FullyShardStrategy(), max_steps=9, callbacks=[callback2], enable_checkpointing=True)
    trainer2.fit(module2, train_loader(), ckpt_path="last")
    if trainer.global_rank == 0:
        results["resume_last"] = {
            "first_step": min(step for step, _ in module2.losses),
            "final_step": trainer2.global_step,
            "dir": sorted(os.listdir(root)),
        }


# ---------------------------------------------------------------------- resharding chain
CHAIN = [  # (stage, world size of the launch that runs it, strategy)
    ("a", 4, "2d"),
    ("b", 2, "fsdp"),
    ("c", 2, "replicate"),
    ("d", 1, "fsdp"),
    ("e", 2, "2d"),
]


def _chain_state(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    state = {f"model.{k}": v for k, v in full_params(trainer).items()}
    state.update(flat_tensors("optim", full_optimizer(trainer)))
    return state


def _chain_step(results: dict, stage: str) -> None:
    index = [s for s, *_ in CHAIN].index(stage)
    _, world, strategy = CHAIN[index]
    assert world_size() == world, f"chain stage {stage!r} must run on {world} ranks, not {world_size()}"
    root = workdir() / "chain"
    module = ResumeModule()
    if index == 0:
        trainer = trainer_for(strategy_for(strategy), max_steps=4)
        trainer.fit(module, train_loader())
        compare = None
    else:
        previous = CHAIN[index - 1][0]
        trainer = trainer_for(strategy_for(strategy), max_steps=4)  # already reached: restores, trains nothing
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, train_loader(), ckpt_path=str(root / f"{previous}.ckpt"))
        compare = previous
    state = _chain_state(trainer)
    trainer.save_checkpoint(root / f"{stage}.ckpt")
    if trainer.global_rank == 0:
        torch.save(state, root / f"{stage}.reference.pt")
        entry = {"global_step": trainer.global_step, "lr": trainer.optimizers[0].param_groups[0]["lr"]}
        if compare is not None:
            reference = torch.load(root / f"{compare}.reference.pt")
            entry["max_diff_to_previous"] = max_diff(state, reference)
            entry["keys"] = len(state)
        results[f"chain_{stage}"] = entry


def group_chain_a(results):
    (workdir() / "chain").mkdir(exist_ok=True)
    _chain_step(results, "a")


def group_chain_bc(results):
    _chain_step(results, "b")
    _chain_step(results, "c")


def group_chain_d(results):
    _chain_step(results, "d")


def group_chain_e(results):
    _chain_step(results, "e")


# ---------------------------------------------------------------------- data position when the dp size changes
def group_data_position_save(results):
    """Save mid-epoch on this world size; `group_data_position_load` resumes on another and checks the samples."""
    root = workdir() / "position"
    callback = ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=3, save_top_k=-1)
    module = ResumeModule()
    trainer = trainer_for(FullyShardStrategy(), max_steps=3, callbacks=[callback], enable_checkpointing=True)
    trainer.fit(module, train_loader())
    seen = gather(module.seen)
    if trainer.global_rank == 0:
        results["position_save"] = {"seen": sorted(i for rank_seen in seen for i in rank_seen)}


def group_data_position_load(results):
    module = ResumeModule()
    trainer = trainer_for(FullyShardStrategy(), max_epochs=1, max_steps=-1)
    trainer.fit(module, train_loader(), ckpt_path=str(workdir() / "position" / "step=3.ckpt"))
    seen = gather(module.seen)
    if trainer.global_rank == 0:
        results["position_load"] = {
            "seen": sorted(i for rank_seen in seen for i in rank_seen),
            "global_step": trainer.global_step,
        }


# ---------------------------------------------------------------------- strict loading and bad input
def group_bad_input(results):
    root = workdir() / "bad"
    module = ResumeModule()
    trainer = trainer_for(FullyShardStrategy(), max_steps=2)
    trainer.fit(module, train_loader())
    good = root / "good.ckpt"
    trainer.save_checkpoint(good)
    reference = full_params(trainer)

    def validate(ckpt, make=ResumeModule, **kwargs):
        evaluator = make(**kwargs)
        t = trainer_for(FullyShardStrategy())
        t.validate(evaluator, val_loader(), ckpt_path=str(ckpt), verbose=False)
        return t

    cases = {}
    # Non-strict: a model with an extra layer loads the matching keys and reports the rest.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        class Lenient(ResumeModule):
            strict_loading = False

        lenient = validate(good, Lenient, extra_layer=True)
    lenient_params = full_params(lenient)
    if trainer.global_rank == 0:  # full params are gathered onto rank 0 only
        cases["lenient_max_diff"] = max((lenient_params[k] - reference[k]).abs().max().item() for k in reference)
        cases["lenient_extra_is_fresh"] = torch.equal(
            lenient_params["extra.weight"], Lenient(extra_layer=True).extra.weight
        )
    cases["lenient_warning"] = next((str(w.message) for w in caught if "strict_loading=False" in str(w.message)), None)
    # ... and a checkpoint with keys the model lacks loads the rest, reporting them as unexpected.
    lenient.save_checkpoint(root / "with_extra.ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate(root / "with_extra.ckpt", Lenient)
    cases["lenient_unexpected_warning"] = next(
        (str(w.message) for w in caught if "strict_loading=False" in str(w.message)), None
    )
    # The same from a full-format file.
    converter = trainer_for(FullyShardStrategy(checkpoint_format="full"))
    converter.validate(ResumeModule(), val_loader(), ckpt_path=str(good), verbose=False)
    converter.save_checkpoint(root / "good_full.ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate(root / "good_full.ckpt", Lenient, extra_layer=True)
    cases["lenient_full_warning"] = next(
        (str(w.message) for w in caught if "strict_loading=False" in str(w.message)), None
    )
    cases["strict_extra"] = error_of(lambda: validate(good, extra_layer=True))
    cases["incompatible"] = error_of(lambda: validate(good, hidden=8))
    cases["missing"] = error_of(lambda: validate(root / "missing.ckpt"))
    if trainer.global_rank == 0:
        (root / "not_a_checkpoint").mkdir()
        (root / "not_a_checkpoint" / "notes.txt").write_text("hi")
        for name in ("truncated.ckpt", "corrupted.ckpt"):
            os.system(f"cp -r {good} {root / name}")
        shard = root / "truncated.ckpt" / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[:100])
        shard = root / "corrupted.ckpt" / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        # Written by a future lightning_dpar: a sharded directory and a full-format file.
        os.system(f"cp -r {good} {root / 'newer_sharded.ckpt'}")
        meta = torch.load(root / "newer_sharded.ckpt" / "meta.pt", weights_only=False)
        meta["dpar"]["format_version"] = 99
        torch.save(meta, root / "newer_sharded.ckpt" / "meta.pt")
        torch.save({"state_dict": {}, "dpar": {"format_version": 99}}, root / "newer_full.ckpt")
    dist.barrier()
    cases["not_a_checkpoint"] = error_of(lambda: validate(root / "not_a_checkpoint"))
    cases["not_a_checkpoint_file"] = error_of(lambda: validate(root / "not_a_checkpoint" / "notes.txt"))
    cases["truncated"] = error_of(lambda: validate(root / "truncated.ckpt"))
    cases["corrupted"] = error_of(lambda: validate(root / "corrupted.ckpt"))
    cases["newer_sharded"] = error_of(lambda: validate(root / "newer_sharded.ckpt"))
    cases["newer_full"] = error_of(lambda: validate(root / "newer_full.ckpt"))
    all_cases = gather(cases)
    if trainer.global_rank == 0:
        results["bad_input"] = {"root": str(root), "per_rank": all_cases}


# ---------------------------------------------------------------------- kill during save
class KillDuringThirdSave(Callback):
    """SIGKILLs rank 0 in the middle of the third save: after every rank wrote its shards, before `meta.pt`."""

    def setup(self, trainer, pl_module, stage):
        original = checkpoint_writer._finish
        count = {"saves": 0}

        def finish(partial, final, metadata, group):
            count["saves"] += 1
            if count["saves"] == 3 and dist.get_rank() == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(partial, final, metadata, group)

        checkpoint_writer._finish = finish


def group_kill(results):
    root = workdir() / "kill"
    callback = ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=1, save_top_k=-1, save_last=True)
    trainer = trainer_for(
        FullyShardStrategy(), max_steps=10, callbacks=[callback, KillDuringThirdSave()], enable_checkpointing=True
    )
    trainer.fit(ResumeModule(), train_loader())


def group_after_kill(results):
    """In a fresh launch: the checkpoints before the kill load; the partial one is invisible or refused."""
    root = workdir() / "kill"
    names = sorted(os.listdir(root))
    partial = [n for n in names if n.startswith(".dpar-partial-")]
    loaded = {}
    for name in ("step=1.ckpt", "last.ckpt"):
        module = ResumeModule()
        trainer = trainer_for(FullyShardStrategy(), max_steps=3)
        trainer.callbacks.append(ModelCheckpoint(dirpath=root, save_top_k=0, save_last=False))  # for "last"
        trainer.fit(module, train_loader(), ckpt_path="last" if name == "last.ckpt" else str(root / name))
        loaded[name] = min(step for step, _ in module.losses) if module.losses else None
    refused = error_of(
        lambda: trainer_for(FullyShardStrategy()).validate(
            ResumeModule(), val_loader(), ckpt_path=str(root / partial[0]) if partial else "none", verbose=False
        )
    )
    if dist.get_rank() == 0:
        results["after_kill"] = {
            "names": names,
            "partial": partial,
            "partial_content": sorted(os.listdir(root / partial[0])) if partial else [],
            "first_step": loaded,
            "refused": refused,
        }


# ---------------------------------------------------------------------- full format, fsspec, consolidation
def group_full_format(results):
    """`checkpoint_format="full"`: one file that torch.load / load_from_checkpoint read and dpar resumes from."""
    root = workdir() / "full"
    module = ResumeModule()
    trainer = trainer_for(FullyShardStrategy(checkpoint_format="full"), max_steps=4)
    trainer.fit(module, train_loader())
    reference = full_params(trainer)
    trainer.save_checkpoint(root / "full.ckpt")
    resumed = ResumeModule()
    trainer2 = trainer_for(ReplicateStrategy(), max_steps=4)
    trainer2.fit(resumed, train_loader(), ckpt_path=str(root / "full.ckpt"))
    resumed_params = full_params(trainer2)
    # Sharded through a `file://` URL: the fsspec code path on a filesystem every rank shares.
    url = f"file://{root / 'url.ckpt'}"
    trainer2.save_checkpoint(url)
    evaluator = ResumeModule()
    trainer3 = trainer_for(FullyShardStrategy())
    trainer3.validate(evaluator, val_loader(), ckpt_path=url, verbose=False)
    url_params = full_params(trainer3)
    if trainer.global_rank == 0:
        plain = torch.load(root / "full.ckpt", weights_only=True)
        from_file = ResumeModule.load_from_checkpoint(root / "full.ckpt")
        results["full_format"] = {
            "is_file": (root / "full.ckpt").is_file(),
            "plain_load_diff": max_diff(plain["state_dict"], reference),
            "optimizer_keys": sorted(plain["optimizer_states"][0]["state"])[:3],
            "load_from_checkpoint_diff": max_diff(from_file.state_dict(), reference),
            "dpar_resume_diff": max_diff(resumed_params, reference),
            "file_url_diff": max_diff(url_params, reference),
        }


def group_memory_fs(results):
    """A `memory://` fsspec filesystem (one process: memory:// is per process) through ModelCheckpoint."""
    import fsspec

    module = ResumeModule()
    callback = ModelCheckpoint(dirpath="memory://mc", filename="{step}", every_n_train_steps=2, save_top_k=1)
    trainer = trainer_for(FullyShardStrategy(), max_steps=6, callbacks=[callback], enable_checkpointing=True)
    trainer.fit(module, train_loader())
    reference = full_params(trainer)
    evaluator = ResumeModule()
    trainer2 = trainer_for(FullyShardStrategy())
    trainer2.validate(evaluator, val_loader(), ckpt_path="memory://mc/step=6.ckpt", verbose=False)
    fs = fsspec.filesystem("memory")
    results["memory_fs"] = {
        "listing": sorted(p.rsplit("/", 1)[-1] for p in fs.ls("/mc", detail=False)),
        "files": sorted(p.rsplit("/", 1)[-1] for p in fs.ls("/mc/step=6.ckpt", detail=False)),
        "load_diff": max_diff(full_params(trainer2), reference),
    }


def group_export(results):
    """Consolidate the 4-rank 2D checkpoint of the chain (TP + FSDP shards) in this single process."""
    from safetensors.torch import load_file

    import lightning_dpar
    from lightning_dpar.consolidate import main as consolidate

    root = workdir() / "chain"
    reference = torch.load(root / "a.reference.pt")
    model_reference = {k.removeprefix("model."): v for k, v in reference.items() if k.startswith("model.")}
    out = workdir() / "export"
    codes = [
        consolidate([str(root / "a.ckpt"), str(out / "a.ckpt")]),
        consolidate([str(root / "a.ckpt"), str(out / "st"), "--format", "safetensors", "--max-shard-size", "2KB"]),
        consolidate([str(workdir() / "bad" / "truncated.ckpt"), str(out / "bad.ckpt")]),
    ]
    single = torch.load(out / "a.ckpt", weights_only=True)
    optimizer = single["optimizer_states"][0]
    names = list(model_reference)
    optimizer_diff = max(
        (optimizer["state"][i][field] - reference[f"optim.state.{name}.{field}"]).abs().max().item()
        for i, name in enumerate(names)
        for field in ("exp_avg", "exp_avg_sq")
    )
    safetensors = {}
    for file in sorted((out / "st").glob("*.safetensors")):
        safetensors.update(load_file(file))
    # A plain single-device Trainer resumes from the consolidated file (optimizer keyed by position).
    module = ResumeModule()
    plain = L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False)
    plain.fit(module, train_loader(), ckpt_path=str(out / "a.ckpt"))
    helper = lightning_dpar.load_from_checkpoint(ResumeModule, root / "a.ckpt")
    results["export"] = {
        "codes": codes,
        "ckpt_model_diff": max_diff(single["state_dict"], model_reference),
        "ckpt_optimizer_diff": optimizer_diff,
        "ckpt_param_ids": optimizer["param_groups"][0]["params"],
        "safetensors_files": len(list((out / "st").glob("*.safetensors"))),
        "safetensors_index": (out / "st" / "model.safetensors.index.json").exists(),
        "safetensors_diff": max_diff(safetensors, model_reference),
        "plain_resume_first_step": min(step for step, _ in module.losses),
        "plain_resume_final_step": plain.global_step,
        "helper_diff": max_diff(helper.state_dict(), model_reference),
    }


class WideModule(L.LightningModule):
    """128 MiB of weights in 32 tensors of 4 MiB: big enough that holding the model would show in RSS."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(32)))

    def training_step(self, batch, batch_idx):
        return self.body(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


_MEASURE_PEAK = """
import sys
from lightning_dpar.consolidate import main
def status(field):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field)) / 1024
before = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")
assert main(sys.argv[1:]) == 0
print(status("VmHWM") - before)
"""


def group_export_memory(results):
    """Peak RSS growth of `consolidate` in a fresh process: safetensors streams; the .ckpt holds the model."""
    import subprocess

    root = workdir() / "wide"
    trainer = trainer_for(FullyShardStrategy(), max_steps=1)
    trainer.fit(WideModule(), DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 1024)), batch_size=4))
    trainer.save_checkpoint(root / "wide.ckpt")
    growth = {}
    for fmt, extra in (("safetensors", ["--max-shard-size", "8MB"]), ("lightning", [])):
        argv = [str(root / "wide.ckpt"), str(root / f"out_{fmt}"), "--format", fmt, *extra]
        proc = subprocess.run(
            [sys.executable, "-c", _MEASURE_PEAK, *argv], capture_output=True, text=True, env=os.environ.copy()
        )
        growth[fmt] = float(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else proc.stderr[-2000:]
    results["export_memory"] = {"model_mib": 128.0, "peak_growth_mib": growth}


# ---------------------------------------------------------------------- migration from Lightning's strategies
def _migrate(results: dict, name: str, trainer: L.Trainer, save) -> None:
    """Resume under dpar_fsdp from a checkpoint `save(trainer, path)` wrote; compare model and optimizer exactly."""
    path = workdir() / "migrate" / f"{name}.ckpt"
    save(trainer, path)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    reference = {k.removeprefix("_forward_module."): v for k, v in full_params(trainer).items()}
    optimizer = trainer.optimizers[0]
    reference_optim = flat_tensors("optim", get_optimizer_state_dict(trainer.model, optimizer, options=options))
    resumed = ResumeModule()
    trainer2 = trainer_for(FullyShardStrategy(), max_steps=6)
    trainer2.fit(resumed, train_loader(), ckpt_path=str(path))
    # The state right after loading: a Trainer that trains nothing (max_steps already reached).
    loaded = ResumeModule()
    trainer3 = trainer_for(FullyShardStrategy(), max_steps=4)
    trainer3.fit(loaded, train_loader(), ckpt_path=str(path))
    params = full_params(trainer3)
    optim = flat_tensors("optim", full_optimizer(trainer3))
    if trainer.global_rank == 0:
        results[f"migrate_{name}"] = {
            "layout": sorted(os.listdir(path)),
            "first_step": min(s for s, _ in resumed.losses),
            "model_diff": max_diff(params, reference),
            "optimizer_diff": max_diff(optim, reference_optim),
        }


class ModelParallelModule(ResumeModule):
    """Written for Lightning's `ModelParallelStrategy`: applies FSDP2 itself in `configure_model`."""

    def configure_model(self):
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.model, FSDPModule):
            return
        for layer in self.model.layers:
            fully_shard(layer, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.model, mesh=self.device_mesh["data_parallel"])


def group_migrate(results):
    """Checkpoints written by Lightning's own strategies resume under dpar.

    `ModelParallelStrategy` runs for real. Lightning's `FSDPStrategy` (FSDP1) needs a GPU in torch>=2.11, so its
    sharded layout (model under `model`) is written by `FSDPStrategy.save_checkpoint` itself on FSDP2 shards.
    """
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    (workdir() / "migrate").mkdir(exist_ok=True)
    trainer = trainer_for(ModelParallelStrategy(data_parallel_size=world_size(), tensor_parallel_size=1), max_steps=4)
    trainer.fit(ModelParallelModule(), train_loader())
    _migrate(results, "model_parallel", trainer, lambda t, path: t.save_checkpoint(path))

    trainer = trainer_for(FullyShardStrategy(), max_steps=4)
    trainer.fit(ResumeModule(), train_loader())

    def save_like_fsdp_strategy(t: L.Trainer, path: Path) -> None:
        checkpoint = t._checkpoint_connector.dump_checkpoint()
        t.strategy._state_dict_type = "sharded"
        FSDPStrategy.save_checkpoint(t.strategy, checkpoint, path)
        t.strategy.barrier()

    _migrate(results, "fsdp_strategy_sharded", trainer, save_like_fsdp_strategy)


GROUPS = {
    "ckpt_full_format": group_full_format,
    "ckpt_memory_fs": group_memory_fs,
    "ckpt_export": group_export,
    "ckpt_export_memory": group_export_memory,
    "ckpt_migrate": group_migrate,
    "ckpt_resume": group_resume,
    "ckpt_resume_last": group_resume_last,
    "ckpt_chain_a": group_chain_a,
    "ckpt_chain_bc": group_chain_bc,
    "ckpt_chain_d": group_chain_d,
    "ckpt_chain_e": group_chain_e,
    "ckpt_position_save": group_data_position_save,
    "ckpt_position_load": group_data_position_load,
    "ckpt_bad_input": group_bad_input,
    "ckpt_kill": group_kill,
    "ckpt_after_kill": group_after_kill,
}
