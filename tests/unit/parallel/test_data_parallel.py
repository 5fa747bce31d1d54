"""The data-parallel step's wrappers, and the per-step work they must not add over a hand-written FSDP2 loop (see
docs/benchmarks.md, "Where the step time goes"). In-process, one-rank gloo group: FSDP2's resharding decisions do
not depend on the world size."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from lightning_dpar.parallel import data_parallel
from lightning_dpar.plan.structure import data_parallel_roots


class BlocksAndHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class LightningShaped(nn.Module):
    """LightningModule-shaped: one top-level child (the FSDP root) holding blocks and a head of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.model = BlocksAndHead()


def _wrap(module: nn.Module, reshard_after_forward: bool | int) -> None:
    mesh = init_device_mesh("cpu", (1,))
    units = ["model.blocks.0", "model.blocks.1"]
    policy = lambda root: MixedPrecisionPolicy()  # noqa: E731
    data_parallel.apply_fully_shard(module, mesh, units, policy, data_parallel_roots(module), reshard_after_forward)


def test_root_keeps_its_parameters_from_forward_to_backward(gloo_world):
    """`reshard_after_forward=True` reshards the blocks, not the root: its parameters are needed again at once in
    backward, so resharding them would cost one more all-gather every step (as the plain loop does not)."""
    module = LightningShaped()
    _wrap(module, reshard_after_forward=True)
    loss = module.model(torch.randn(3, 4)).sum()
    assert isinstance(module.model.blocks[0].weight, DTensor)  # a block: resharded after its forward
    assert not isinstance(module.model.head.weight, DTensor)  # the root's own head: still unsharded
    loss.backward()
    assert isinstance(module.model.head.weight, DTensor)  # resharded after backward, as always


def test_explicit_false_still_applies_to_every_unit(gloo_world):
    module = LightningShaped()
    _wrap(module, reshard_after_forward=False)
    module.model(torch.randn(3, 4)).sum()
    assert not isinstance(module.model.blocks[0].weight, DTensor)
    assert not isinstance(module.model.head.weight, DTensor)


def test_reshard_frees_a_root_kept_unsharded_after_an_evaluation_forward(gloo_world):
    """An evaluation step runs no backward, so the root's post-backward reshard never comes: `reshard` registers the
    shards again, as callbacks between steps must see them."""
    module = LightningShaped()
    _wrap(module, reshard_after_forward=True)
    with torch.no_grad():
        module.model(torch.randn(3, 4))
    assert not isinstance(module.model.head.weight, DTensor)
    data_parallel.reshard([module.model])
    assert isinstance(module.model.head.weight, DTensor)


def test_outermost_units_and_ignored_parameters(gloo_world):
    module = LightningShaped()
    _wrap(module, reshard_after_forward=True)
    assert data_parallel.outermost_fsdp_modules(module) == [module.model]
    assert isinstance(module.model.blocks[0], FSDPModule)  # a unit, but enclosed by the root
    ignored = data_parallel.ignored_parameters(LightningShaped(), ["model.head"])
    assert len(ignored) == 2 and all(p.shape in ((2, 4), (2,)) for p in ignored)


def test_the_steps_slice_is_the_wrappers_units_roots_and_settings():
    """`STEP`, the binding the list of steps walks: its slice comes from the model's facts and the options (the
    unsynchronised modules resolved); a tied parameter split across DDP's units is refused before any collective."""
    import pytest

    from lightning_dpar.parallel.facts import model_facts
    from lightning_dpar.parallel_dims import ParallelDims
    from lightning_dpar.plan import PlanOptions
    from lightning_dpar.steps.contract import Planning

    dims = ParallelDims(2, 1, 2, 1)
    options = PlanOptions("FullyShardStrategy", shards=True, ignored_modules=["model.head"])
    module = LightningShaped()
    part = data_parallel.STEP.plan(Planning(module, dims, options, model_facts(module, dims, options)))
    assert part["shard_units"] == ["model.blocks.0", "model.blocks.1"] and part["data_parallel_roots"] == ["model"]
    assert part["ignored"] == ["model.head"] and not part["adopted_sharded"]
    assert part["data_parallel"].wrapper == "fully_shard"
    tied = nn.Module()
    tied.a, tied.b = nn.Linear(4, 4), nn.Linear(4, 4)
    tied.b.weight = tied.a.weight
    ddp = PlanOptions("ReplicateStrategy", ddp_units=True)
    ddp_dims = ParallelDims(2, 2, 1, 1)
    with pytest.raises(ValueError, match="separate DDP units that cannot share a parameter"):
        data_parallel.STEP.plan(Planning(tied, ddp_dims, ddp, model_facts(tied, ddp_dims, ddp)))
