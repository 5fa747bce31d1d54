"""Cases for `tests/launched/test_checkpoint_reshard.py`: one checkpoint through other strategies and world sizes (the
resharding chain), the data position on another data-parallel size, and the chain's 4-rank 2D checkpoint
consolidated in one process.

Each stage loads what the previous stage saved in an earlier launch (or earlier in its own launch), from the
directory the test's fixture passes (`checkpoint_common.saved_by`); a stage whose input is missing fails naming it.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dpar import FullyShardStrategy
from tests.workers.cases import Case, one_case
from tests.workers.checkpoint_common import (
    ResumeModule,
    case_dir,
    flat_tensors,
    full_optimizer,
    gather,
    max_diff,
    saved_by,
    strategy_for,
    train_loader,
)
from tests.workers.common import full_params, trainer_for, world_size

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


def chain_case(stage: str) -> dict:
    """Stage a trains 4 steps; every later stage resumes the previous stage's checkpoint under its own strategy and
    world size (training nothing more) and compares the full model and optimizer state with the previous stage's.
    Each saves `<stage>.ckpt` and its full state, `<stage>.reference.pt`, under `case_dir("chain_<stage>")`."""
    index = [s for s, *_ in CHAIN].index(stage)
    _, world, strategy = CHAIN[index]
    assert world_size() == world, f"chain stage {stage!r} must run on {world} ranks, not {world_size()}"
    root = case_dir(f"chain_{stage}")
    module = ResumeModule()
    trainer = trainer_for(strategy_for(strategy), max_steps=4)  # after stage a: already reached, trains nothing
    previous = CHAIN[index - 1][0] if index else None
    if previous is None:
        trainer.fit(module, train_loader())
    else:
        trainer.fit(module, train_loader(), ckpt_path=str(saved_by(f"chain_{previous}", f"{previous}.ckpt")))
    state = _chain_state(trainer)
    trainer.save_checkpoint(root / f"{stage}.ckpt")
    if trainer.global_rank != 0:
        return None
    root.mkdir(parents=True, exist_ok=True)
    torch.save(state, root / f"{stage}.reference.pt")
    entry = {"global_step": trainer.global_step, "lr": trainer.optimizers[0].param_groups[0]["lr"]}
    if previous is not None:
        reference = torch.load(saved_by(f"chain_{previous}", f"{previous}.reference.pt"))
        entry["max_diff_to_previous"] = max_diff(state, reference)
        entry["keys"] = len(state)
    return entry


def chain_stage(stage: str):
    return one_case(f"chain_{stage}", lambda: chain_case(stage))


# ---------------------------------------------------------------------- data position when the dp size changes
def position_save_case() -> dict:
    """Save mid-epoch on this world size; `position_load_case` resumes on another and checks the samples."""
    callback = ModelCheckpoint(
        dirpath=case_dir("position_save"), filename="{step}", every_n_train_steps=3, save_top_k=-1
    )
    module = ResumeModule()
    trainer = trainer_for(FullyShardStrategy(), max_steps=3, callbacks=[callback], enable_checkpointing=True)
    trainer.fit(module, train_loader())
    seen = gather(module.seen)
    return {"seen": sorted(i for rank_seen in seen for i in rank_seen)}


def position_load_case() -> dict:
    module = ResumeModule()
    trainer = trainer_for(FullyShardStrategy(), max_epochs=1, max_steps=-1)
    trainer.fit(module, train_loader(), ckpt_path=str(saved_by("position_save", "step=3.ckpt")))
    seen = gather(module.seen)
    return {"seen": sorted(i for rank_seen in seen for i in rank_seen), "global_step": trainer.global_step}


# ---------------------------------------------------------------------- consolidating stage a in one process
def _chain_a_reference() -> tuple[dict, dict]:
    """Stage a's full state, and its model part under the model's own names."""
    reference = torch.load(saved_by("chain_a", "a.reference.pt"))
    return reference, {k.removeprefix("model."): v for k, v in reference.items() if k.startswith("model.")}


def _consolidate(*args: str) -> int:
    from lightning_dpar.checkpoint.consolidate import main as consolidate

    return consolidate([str(saved_by("chain_a", "a.ckpt")), *args])


def export_ckpt_case() -> dict:
    """Consolidate the 4-rank 2D checkpoint (TP + FSDP shards) into one Lightning `.ckpt` in this process."""
    reference, model_reference = _chain_a_reference()
    out = case_dir("export_ckpt") / "a.ckpt"
    code = _consolidate(str(out))
    single = torch.load(out, weights_only=True)
    optimizer = single["optimizer_states"][0]
    optimizer_diff = max(
        (optimizer["state"][i][field] - reference[f"optim.state.{name}.{field}"]).abs().max().item()
        for i, name in enumerate(model_reference)
        for field in ("exp_avg", "exp_avg_sq")
    )
    return {
        "code": code,
        "ckpt_model_diff": max_diff(single["state_dict"], model_reference),
        "ckpt_optimizer_diff": optimizer_diff,
        "ckpt_param_ids": optimizer["param_groups"][0]["params"],
    }


def export_safetensors_case() -> dict:
    """Consolidate the 4-rank 2D checkpoint into sharded safetensors files with an index."""
    from safetensors.torch import load_file

    _, model_reference = _chain_a_reference()
    out = case_dir("export_safetensors")
    code = _consolidate(str(out), "--format", "safetensors", "--max-shard-size", "2KB")
    safetensors = {}
    for file in sorted(out.glob("*.safetensors")):
        safetensors.update(load_file(file))
    return {
        "code": code,
        "safetensors_files": len(list(out.glob("*.safetensors"))),
        "safetensors_index": (out / "model.safetensors.index.json").exists(),
        "safetensors_diff": max_diff(safetensors, model_reference),
    }


def export_truncated_case() -> int:
    """`consolidate` on a copy of the 4-rank checkpoint with a truncated shard: its exit status."""
    from lightning_dpar.checkpoint.consolidate import main as consolidate

    root = case_dir("export_truncated")
    truncated = root / "truncated.ckpt"
    shutil.copytree(saved_by("chain_a", "a.ckpt"), truncated, dirs_exist_ok=True)
    shard = truncated / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    return consolidate([str(truncated), str(root / "out.ckpt")])


def export_plain_resume_case() -> dict:
    """A plain single-device Trainer resumes from the consolidated file (optimizer keyed by position)."""
    out = case_dir("export_plain_resume") / "a.ckpt"
    code = _consolidate(str(out))
    module = ResumeModule()
    plain = L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False)
    plain.fit(module, train_loader(), ckpt_path=str(out))
    return {
        "code": code,
        "plain_resume_first_step": min(step for step, _ in module.losses),
        "plain_resume_final_step": plain.global_step,
    }


def export_helper_case() -> float:
    """`lightning_dpar.load_from_checkpoint` reads the sharded 4-rank directory in one process."""
    import lightning_dpar

    _, model_reference = _chain_a_reference()
    helper = lightning_dpar.load_from_checkpoint(ResumeModule, saved_by("chain_a", "a.ckpt"))
    return max_diff(helper.state_dict(), model_reference)


def group_export() -> Iterator[Case]:
    yield Case("export_ckpt", export_ckpt_case)
    yield Case("export_safetensors", export_safetensors_case)
    yield Case("export_truncated", export_truncated_case)
    yield Case("export_plain_resume", export_plain_resume_case)
    yield Case("export_helper", export_helper_case)


GROUPS = {
    "reshard_chain_a": chain_stage("a"),
    "reshard_chain_b": chain_stage("b"),
    "reshard_chain_c": chain_stage("c"),
    "reshard_chain_d": chain_stage("d"),
    "reshard_chain_e": chain_stage("e"),
    "reshard_position_save": one_case("position_save", position_save_case),
    "reshard_position_load": one_case("position_load", position_load_case),
    "reshard_export": group_export,
}
