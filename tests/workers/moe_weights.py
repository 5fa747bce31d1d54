"""Mixture-of-experts weights on several ranks: every on-disk layout of a tiny Qwen3-MoE and Mixtral loaded into
`dpar_fsdp`'s shards exactly; what each rank reads of the per-expert tensors when the experts are FSDP-sharded,
expert-parallel (an `expert` mesh dim), both at once (`_StridedShard` + `Shard` on dim 0), or split by rows; a
directory lacking an expert refused on every rank; and `consolidate --format hf` of a sharded checkpoint loaded back
by `from_pretrained`.

The directories are written by the pytest side (`tests/launched/test_moe_weights.py`, with `tests/support/moe.py`)
next to the results directory.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_dpar import FullyShardStrategy, PretrainedWeights
from lightning_dpar.hf_weights.pretrained import PretrainedLoadError, load_pretrained
from tests.support import moe
from tests.workers.cases import Case, one_case
from tests.workers.common import full_params, trainer_for, world_size
from tests.workers.pretrained import CaptureStart, CausalLM, TokenData, workdir


def layout_dir(kind: str, layout: str) -> str:
    return str(workdir() / f"{kind}_{layout}")


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], prefix: str) -> float:
    assert {k for k in got if k.startswith(prefix)} == {prefix + k for k in want}, "different keys"
    return max((got[prefix + k] - v).abs().max().item() for k, v in want.items())


def load_case(kind: str, layout: str, expert_parallel_size: int = 1) -> dict | None:
    """`FullyShardStrategy(pretrained=...)` on every rank (with `expert_parallel_size`): the full parameters right
    after setup, against the model the directory was written from."""
    path = layout_dir(kind, layout)
    capture = CaptureStart()
    strategy = FullyShardStrategy(pretrained=path, expert_parallel_size=expert_parallel_size)
    trainer = trainer_for(strategy, max_steps=1, callbacks=[capture])
    module = CausalLM(path)
    experts = module.model.model.layers[0].mlp.experts
    trainer.fit(module, DataLoader(TokenData(128, n=8), batch_size=2))
    local = experts.gate_up_proj.to_local().shape  # each rank holds E / 2 experts
    if trainer.global_rank != 0:
        return None
    source = moe.source(kind).state_dict()
    return {
        "loaded_max_abs_diff": max_diff(capture.params, source, "model."),
        "random_init_diff": max_diff(CausalLM(path).state_dict(), source, "model."),
        "local_gate_up_shape": list(local),
    }


def shard_experts(module: torch.nn.Module, placements_for) -> None:
    """Replace every fused expert parameter with a DTensor of the placements `placements_for(name)` gives."""
    from torch.distributed.tensor import distribute_tensor

    for experts in (m for m in module.modules() if type(m).__name__.endswith("Experts")):
        for name in ("gate_up_proj", "down_proj"):
            mesh, placements = placements_for(name)
            full = getattr(experts, name).detach()
            setattr(experts, name, torch.nn.Parameter(distribute_tensor(full, mesh, placements)))


def slices_case(sharding: str) -> dict | None:
    """`load_pretrained` into experts sharded by hand: the per-expert slices each rank read (layer 0's), and the
    loaded values against the source."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    kind = "qwen3_moe"
    holder = torch.nn.Module()
    holder.net = moe.source(kind, seed=1)
    if sharding == "fsdp":  # dpar_fsdp's wrapping: each decoder layer, then the root
        mesh = init_device_mesh("cpu", (world_size(),), mesh_dim_names=("dp",))
        for layer in holder.net.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(holder, mesh=mesh)
    elif sharding == "expert":  # expert parallel: dim 0 over an `expert` mesh dim
        mesh = init_device_mesh("cpu", (world_size(),), mesh_dim_names=("expert",))
        shard_experts(holder, lambda name: (mesh, [Shard(0)]))
    elif sharding == "rows":  # each rank a half of every expert's rows: gate or up, half of down's rows
        mesh = init_device_mesh("cpu", (world_size(),), mesh_dim_names=("expert",))
        shard_experts(holder, lambda name: (mesh, [Shard(1)]))
    elif sharding == "expert_fsdp":  # expert parallel 2 x FSDP 2 on top: (_StridedShard(0), Shard(0))
        mesh = init_device_mesh("cpu", (2, world_size() // 2), mesh_dim_names=("dp", "expert"))
        shard_experts(holder, lambda name: (mesh["expert"], [Shard(0)]))
        for layer in holder.net.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(holder, mesh=mesh["dp"])
    placements = [repr(p) for p in holder.net.model.layers[0].mlp.experts.gate_up_proj.placements]
    loaded = load_pretrained(holder, PretrainedWeights(layout_dir(kind, "save_pretrained")))
    ours = sorted(s for s in loaded.expert_slices if s.startswith("model.layers.0."))
    gathered = [None] * world_size()
    dist.all_gather_object(gathered, ours)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in holder.state_dict().items()}
    if dist.get_rank() != 0:
        return None
    return {
        "placements": placements,
        "slices_by_rank": gathered,
        "loaded_max_abs_diff": max_diff(full, moe.source(kind).state_dict(), "net."),
    }


def errors_case() -> dict | None:
    """A directory without one expert's `up_proj`: every rank refuses it, naming the key, before reading."""
    path = workdir() / "qwen3_moe_incomplete"
    messages = []
    try:
        trainer = trainer_for(FullyShardStrategy(pretrained=str(path)), max_steps=1)
        trainer.fit(CausalLM(str(path)), DataLoader(TokenData(128, n=8), batch_size=2))
    except PretrainedLoadError as error:
        messages.append(str(error))
    gathered = [None] * world_size()
    dist.all_gather_object(gathered, messages)
    return gathered if dist.get_rank() == 0 else None


def export_case(kind: str) -> dict | None:
    """Fine-tune from the `save_pretrained` directory under `dpar_fsdp`, save a sharded checkpoint, export it with
    `consolidate --format hf` (several files) and load that with `from_pretrained`."""
    from transformers import AutoModelForCausalLM

    from lightning_dpar.checkpoint.consolidate import main as consolidate
    from lightning_dpar.hf_weights.pretrained import checkpoint_shapes

    path = layout_dir(kind, "save_pretrained")
    trainer = trainer_for(FullyShardStrategy(pretrained=path), max_steps=2)
    trainer.fit(CausalLM(path), DataLoader(TokenData(128, n=8), batch_size=2))
    ckpt = workdir() / f"{kind}_trained.ckpt"
    trainer.save_checkpoint(ckpt)
    trained = full_params(trainer)
    if trainer.global_rank != 0:
        return None
    out = workdir() / f"{kind}_exported"
    code = consolidate([str(ckpt), str(out), "--format", "hf", "--max-shard-size", "30KB"])
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    return {
        "code": code,
        "files": len(list(out.glob("*.safetensors"))),
        "same_keys_as_save_pretrained": set(checkpoint_shapes(out)) == set(checkpoint_shapes(path)),
        "missing": sorted(info["missing_keys"]),
        "unexpected": sorted(info["unexpected_keys"]),
        "mismatched": sorted(map(str, info["mismatched_keys"])),
        "max_abs_diff": max_diff(trained, model.state_dict(), "model."),
        "trained_from_source": max_diff(trained, moe.source(kind).state_dict(), "model."),
    }


def group_moe_load() -> Iterator[Case]:
    for kind in moe.KINDS:
        for layout in moe.LAYOUTS:
            yield Case(f"moe_load_{kind}_{layout}", lambda kind=kind, layout=layout: load_case(kind, layout))
            yield Case(f"moe_load_{kind}_{layout}_ep", lambda kind=kind, layout=layout: load_case(kind, layout, 2))


def group_moe_slices() -> Iterator[Case]:
    for sharding in ("fsdp", "expert", "rows"):
        yield Case(f"moe_slices_{sharding}", lambda sharding=sharding: slices_case(sharding))


def group_moe_export() -> Iterator[Case]:
    for kind in moe.KINDS:
        yield Case(f"moe_export_{kind}", lambda kind=kind: export_case(kind))


GROUPS = {
    "moe_load": group_moe_load,
    "moe_slices": group_moe_slices,
    "moe_slices_4": one_case("moe_slices_expert_fsdp", lambda: slices_case("expert_fsdp")),
    "moe_errors": one_case("moe_errors", errors_case),
    "moe_export": group_moe_export,
}
