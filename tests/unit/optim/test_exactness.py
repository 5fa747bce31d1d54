"""The optimizer checks of `lightning_dpar.optim.exactness` in-process: the probe that classifies an update as
elementwise, per-tensor or whole-model, declared kinds, which layouts allow which kinds, the exactness summary and
the dry-run plan's optimizer lines. The 2- and 4-rank training runs are in `tests/launched/test_optimizers.py`
(cases in `tests/workers/optimizers.py`)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_dpar.optim.exactness import (
    ELEMENTWISE_CLASSES,
    NON_ELEMENTWISE_CLASSES,
    OptimizerLayoutError,
    ParameterLayout,
    UpdateKind,
    check_optimizers,
    classify,
    declare_update_kind,
    exactness_summary,
    probe_update_kind,
)
from lightning_dpar.parallel_dims import ParallelDims
from tests.workers.optimizers import OPTIMIZERS, LARSLike

FSDP2 = ParameterLayout.of(ParallelDims(2, replicate=1, shard=2, tensor_parallel=1))
TP2 = ParameterLayout.of(ParallelDims(2, replicate=1, shard=1, tensor_parallel=2))
DDP2 = ParameterLayout.of(ParallelDims(2, replicate=2, shard=1, tensor_parallel=1))
PIPELINE2 = ParameterLayout.of(ParallelDims(2, replicate=1, shard=1, tensor_parallel=1, pipeline=2))


def _params():
    return [torch.nn.Parameter(torch.randn(4, 3))]


@pytest.mark.parametrize("cls", sorted(ELEMENTWISE_CLASSES - {torch.optim.SparseAdam}, key=lambda c: c.__name__))
def test_probe_agrees_that_known_elementwise_classes_are_elementwise(cls):
    assert probe_update_kind(cls(_params())).kind is UpdateKind.ELEMENTWISE


@pytest.mark.parametrize("cls", [torch.optim.Muon, torch.optim.Adafactor])
def test_probe_finds_known_per_tensor_classes(cls):
    assert NON_ELEMENTWISE_CLASSES[cls][0] is UpdateKind.PER_TENSOR
    assert probe_update_kind(cls(_params())).kind is UpdateKind.PER_TENSOR


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, foreach=True),
        lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True, fused=True),
        lambda p: torch.optim.AdamW(p, lr=1e-7, weight_decay=0.1, foreach=False),  # a tiny lr still compares
        lambda p: torch.optim.RMSprop(p, centered=True, momentum=0.5),
    ],
)
def test_probe_sees_foreach_and_fused_forms_as_elementwise(make):
    assert probe_update_kind(make(_params())).kind is UpdateKind.ELEMENTWISE


def test_probe_tells_per_tensor_from_whole_model_coupling():
    class GlobalNormSGD(torch.optim.Optimizer):
        def __init__(self, params, lr=0.1):
            super().__init__(params, {"lr": lr})

        @torch.no_grad()
        def step(self):
            params = [p for g in self.param_groups for p in g["params"]]
            norm = torch.sqrt(sum((p.grad**2).sum() for p in params))
            for p in params:
                p.sub_(self.param_groups[0]["lr"] * p.grad / norm)

    assert probe_update_kind(LARSLike(_params())).kind is UpdateKind.PER_TENSOR
    found = probe_update_kind(GlobalNormSGD(_params()))
    assert found.kind is UpdateKind.WHOLE_MODEL and "two tensors stepped together unlike apart" in found.reason


def test_probe_leaves_the_real_optimizer_and_the_global_rng_alone():
    class MyAdam(torch.optim.Adam):  # a subclass is probed: it could override `step`
        pass

    params = _params()
    before = params[0].detach().clone()
    optimizer = MyAdam([{"params": params, "lr": 0.5}, {"params": [torch.nn.Parameter(torch.ones(2))], "lr": 0.1}])
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    assert classify(optimizer).kind is UpdateKind.ELEMENTWISE
    assert torch.equal(torch.rand(3), expected)
    assert torch.equal(params[0], before) and not optimizer.state


def test_probe_that_cannot_step_a_copy_refuses_and_names_the_reason():
    class NeedsClosure(torch.optim.Optimizer):
        def __init__(self, params, lr):  # a required argument: taken from the hyperparameters
            super().__init__(params, {"lr": lr})

        def step(self, closure):
            closure()

    found = probe_update_kind(NeedsClosure(_params(), lr=0.1))
    assert found.kind is UpdateKind.WHOLE_MODEL and "could not step a copy" in found.reason
    with pytest.raises(OptimizerLayoutError, match=r"NeedsClosure.*declare_update_kind"):
        check_optimizers([NeedsClosure(_params(), lr=0.1)], PIPELINE2, "FullyShardStrategy")


def test_declared_kind_replaces_the_probe():
    class Declared(LARSLike):
        pass

    declare_update_kind(Declared, "elementwise")
    assert classify(Declared(_params())).source == "declared"
    check_optimizers([Declared(_params())], FSDP2, "FullyShardStrategy")  # the user's word is taken
    with pytest.raises(TypeError, match="Optimizer subclass"):
        declare_update_kind(int, "elementwise")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "layout", "allowed"),
    [
        (lambda p: torch.optim.Adafactor(p), DDP2, True),
        (lambda p: torch.optim.Adafactor(p), PIPELINE2, True),  # each stage's tensors are whole
        (lambda p: torch.optim.Adafactor(p), FSDP2, False),
        (lambda p: torch.optim.Adafactor(p), TP2, False),
        (lambda p: torch.optim.LBFGS(p), DDP2, True),
        (lambda p: torch.optim.LBFGS(p), PIPELINE2, False),  # couples tensors of different stages
        (lambda p: LARSLike(p), FSDP2, False),
        (lambda p: torch.optim.AdamW(p), FSDP2, True),
    ],
)
def test_layouts_allow_exactly_the_kinds_they_keep_exact(make, layout, allowed):
    optimizer = make(_params())
    if allowed:
        check_optimizers([optimizer], layout, "S")
    else:
        with pytest.raises(OptimizerLayoutError, match=type(optimizer).__name__):
            check_optimizers([optimizer], layout, "S")


def test_elementwise_classes_take_the_fast_path_without_a_probe(monkeypatch):
    import lightning_dpar.optim.exactness as optimizers

    monkeypatch.setattr(optimizers, "probe_update_kind", lambda o: pytest.fail("probed a known elementwise class"))
    check_optimizers([torch.optim.AdamW(_params(), fused=True), torch.optim.SGD(_params())], FSDP2, "S")


def test_a_probed_optimizer_is_decided_on_shards_where_parameters_are_split():
    """Not elementwise on plain pieces is not the verdict where parameters are DTensors: the shard probe decides,
    and its refusal advises computing on DTensors, not declaring the class elementwise."""
    asked = []

    def exact_on_shards(optimizer):
        asked.append(type(optimizer).__name__)
        return True, ""

    check_optimizers([LARSLike(_params())], FSDP2, "S", probe_on_shards=exact_on_shards)
    check_optimizers([LARSLike(_params())], TP2, "S", probe_on_shards=exact_on_shards)
    assert asked == ["LARSLike", "LARSLike"]
    with pytest.raises(OptimizerLayoutError) as refused:
        check_optimizers([LARSLike(_params())], FSDP2, "S", probe_on_shards=lambda o: (False, "ended 0.1 away"))
    message = str(refused.value)
    assert "nor exact on DTensors" in message and "ended 0.1 away" in message and "to_local()" in message
    assert "declare_update_kind" not in message


def test_a_class_neither_probe_can_step_is_advised_to_declare_its_kind():
    class NeedsClosure(torch.optim.Optimizer):
        def __init__(self, params, lr):
            super().__init__(params, {"lr": lr})

        def step(self, closure):
            closure()

    def cannot_step(optimizer):
        return False, "a copy of NeedsClosure could not step small DTensors placed as its parameters (TypeError)"

    with pytest.raises(OptimizerLayoutError) as refused:
        check_optimizers([NeedsClosure(_params(), lr=0.1)], FSDP2, "S", probe_on_shards=cannot_step)
    assert "declare_update_kind(NeedsClosure, 'elementwise')" in str(refused.value)
    assert "to_local()" not in str(refused.value)


def test_the_shard_probe_is_not_run_where_it_cannot_help():
    def never(optimizer):
        pytest.fail(f"stepped {type(optimizer).__name__} on shards")

    check_optimizers([torch.optim.AdamW(_params()), LARSLike(_params())], DDP2, "S", probe_on_shards=never)
    with pytest.raises(OptimizerLayoutError, match="Adafactor"):  # known: refused by name, as before
        check_optimizers([torch.optim.Adafactor(_params())], FSDP2, "S", probe_on_shards=never)

    class GlobalNormSGD(torch.optim.SGD):  # couples tensors, so pipeline stages cannot hold it exactly
        @torch.no_grad()
        def step(self, closure=None):
            params = [p for g in self.param_groups for p in g["params"]]
            norm = torch.sqrt(sum((p.grad**2).sum() for p in params))
            for p in params:
                p.sub_(0.1 * p.grad / norm)

    pipelined_fsdp = ParameterLayout.of(ParallelDims(4, replicate=1, shard=2, tensor_parallel=1, pipeline=2))
    optimizer = GlobalNormSGD([*_params(), *_params()], lr=0.1)
    with pytest.raises(OptimizerLayoutError, match="GlobalNormSGD"):
        check_optimizers([optimizer], pipelined_fsdp, "S", probe_on_shards=never)


def test_exactness_summary_lines():
    lines = exactness_summary([torch.optim.AdamW(_params()), torch.optim.Adafactor(_params())], FSDP2, "S")
    assert lines[0] == "AdamW: exact (elementwise update)"
    assert lines[1].startswith("Adafactor: refused under this layout, its update is per-tensor")


class BiasFree(L.LightningModule):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(16, 8, bias=False))
        self.optimizer = optimizer

    def configure_optimizers(self):
        return OPTIMIZERS[self.optimizer](self.parameters())


@pytest.mark.usefixtures("no_pytest_argv")
@pytest.mark.parametrize(
    ("strategy", "optimizer", "line"),
    [
        ("fsdp", "adamw", "AdamW: exact (elementwise update)"),
        ("fsdp", "muon", "Muon: exact, each whole matrix's update computed by one rank and sent to the others"),
        ("fsdp", "adafactor", "Adafactor: refused under this layout, its update is per-tensor (it factors"),
        ("offload", "muon", "Muon: refused under this layout"),
        ("replicate", "adafactor", "Adafactor: exact (per-tensor update)"),
        ("replicate", "lars", "LARSLike: exact (per-tensor update)"),
        ("fsdp", "lars", "LARSLike: decided when training starts, its update is not elementwise"),
    ],
)
def test_plan_dry_run_lists_which_optimizers_are_exact(strategy, optimizer, line):
    import lightning_dpar
    from lightning_dpar.estimates import plan

    strategies = {
        "fsdp": lightning_dpar.FullyShardStrategy,
        "offload": lambda: lightning_dpar.FullyShardStrategy(cpu_offload=True),
        "replicate": lightning_dpar.ReplicateStrategy,
    }
    with torch.device("meta"):
        module = BiasFree(optimizer)
    report = plan(strategies[strategy](), module, world_size=4)
    assert report.optimizer_exactness[0].startswith(line), report.optimizer_exactness
    assert "Optimizers under this layout" in report.render()
