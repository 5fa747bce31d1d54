"""Loss parallel's step (`lightning_dpar.loss_parallel.step`): its slice of the plan (the output layer found in the
tensor-parallel styles, every refusal), the output layer's vocabulary-sharded style, the loss handed on as a plain
tensor, and the planning walk with an uneven vocabulary. In-process; the DTensor parts on a one-rank gloo group."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_dpar.loss_parallel import step
from lightning_dpar.parallel import parallelize
from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.plan import PlanOptions

TP2 = ParallelDims(2, 1, 1, 2)


class Tiny(nn.Module):
    """An embedding, a block and an output layer with a vocabulary of 65 (uneven over 2 ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(65, 8)
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 65, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(self.emb(x)))


GATHERED = ColwiseParallel(output_layouts=Replicate())


def test_the_output_layer_is_the_one_gathered_column_wise_module():
    styles = {"fc": ColwiseParallel(), "head": GATHERED}
    assert step.plan_loss_parallel(Tiny(), TP2, True, styles, "S") == "head"
    assert step.plan_loss_parallel(Tiny(), TP2, False, styles, "S") is None
    assert step.gathers_columns(GATHERED) and not step.gathers_columns(ColwiseParallel())


@pytest.mark.parametrize(
    ("dims", "styles", "expected"),
    [
        (ParallelDims(2, 1, 2, 1), {}, "`tensor_parallel_size=1`"),
        (ParallelDims(4, 1, 1, 2, pipeline=2), {"head": GATHERED}, "`pipeline_parallel_size=2` is not supported"),
        (ParallelDims(4, 1, 1, 2, context=2), {"head": GATHERED}, "`context_parallel_size=2` is not supported"),
        (TP2, {"fc": ColwiseParallel()}, "the output layer 'head' has no tensor-parallel style"),
        (TP2, {"head": RowwiseParallel()}, "the output layer 'head' is RowwiseParallel"),
        (TP2, {"head": ColwiseParallel()}, "is ColwiseParallel in the `tp_plan` with its output left sharded"),
        (TP2, {"fc": GATHERED, "head": GATHERED}, "gathers the column-wise output of ['fc', 'head']"),
    ],
)
def test_refusals_name_the_value_and_the_fix(dims, styles, expected):
    with pytest.raises(ValueError) as error:
        step.plan_loss_parallel(Tiny(), dims, True, styles, "FSDPTensorParallelStrategy")
    message = str(error.value)
    assert expected in message, message
    assert "`FSDPTensorParallelStrategy(loss_parallel=True)`" in message and "loss_parallel" in message


@pytest.mark.parametrize(
    "dims",
    [ParallelDims(2, 1, 2, 1), ParallelDims(4, 1, 1, 2, pipeline=2), ParallelDims(4, 1, 1, 2, context=2), TP2],
)
def test_the_layout_refusal_is_the_steps_own_refusal_and_the_layout_searchs_rule(dims):
    """One rule: the layout search runs loss parallel exactly on the layouts whose plan it does not refuse."""
    from lightning_dpar.loss_parallel.cost import runs_loss_parallel

    refusal = step.layout_refusal(dims, "`S(loss_parallel=True)`")
    assert runs_loss_parallel(True, dims) is (refusal is None)
    if refusal is not None:
        with pytest.raises(ValueError) as error:
            step.plan_loss_parallel(Tiny(), dims, True, {"head": GATHERED}, "S")
        assert str(error.value) == refusal


def test_the_output_layer_named_in_a_refusal_is_a_transformers_models_output_embeddings():
    transformers = pytest.importorskip("transformers")
    from tests.support.hf_configs import decoder_config

    with torch.device("meta"):
        holder = nn.Module()
        holder.net = transformers.LlamaForCausalLM(decoder_config())
    assert step.output_layer_candidate(holder) == "net.lm_head"
    assert step.output_layer_candidate(Tiny()) == "head"
    assert step.output_layer_candidate(nn.Embedding(2, 2)) is None


def test_the_output_layers_style_keeps_its_output_sharded_over_the_vocabulary():
    styles = {"fc": ColwiseParallel(), "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    sharded = step.sharded_output_styles(styles, "head")
    head = sharded["head"]
    assert isinstance(head, ColwiseParallel) and head.output_layouts == (Shard(-1),) and not head.use_local_output
    assert head.input_layouts == (Shard(1),) and sharded["fc"] is styles["fc"]
    assert step.sharded_output_styles(styles, None) == styles


def test_planning_relaxes_the_vocabulary_check_for_the_output_layer_only_under_loss_parallel():
    """An uneven vocabulary (65 over 2) is refused for a gathered output layer without loss parallel, planned with
    it; the loss-parallel step's slice names the output layer, and the tensor-parallel slice keeps its planned
    (gathered) style, which the tensor-parallel step applies sharded."""
    from lightning_dpar.plan.tensor_parallel import TensorParallelSizeError

    plan = {"fc": "colwise", "head": "colwise_gather_output"}
    with pytest.raises(TensorParallelSizeError, match="out_features=65 of module 'head'"):
        parallelize.plan_modules(Tiny(), TP2, PlanOptions("S", tp_plan=plan, shards=True))
    planned = parallelize.plan_modules(Tiny(), TP2, PlanOptions("S", tp_plan=plan, shards=True, loss_parallel=True))
    assert planned.loss_parallel == "head" and step.gathers_columns(planned.tensor_parallel["head"])
    with pytest.raises(TensorParallelSizeError, match="num_embeddings=65"):  # other modules keep their check
        options = PlanOptions("S", tp_plan={**plan, "emb": "rowwise"}, shards=True, loss_parallel=True)
        parallelize.plan_modules(Tiny(), TP2, options)


def test_the_loss_is_handed_on_as_a_plain_tensor_with_its_gradient(gloo_world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    logits = torch.randn(6, 5, requires_grad=True)
    labels = torch.tensor([0, 4, -100, 2, 1, 3])
    sharded = DTensor.from_local(logits, mesh, [Shard(-1)])
    with step.around_step("head"):
        loss = F.cross_entropy(sharded, labels)
        assert isinstance(loss, DTensor)
        plain = step.plain_loss({"loss": loss, "other": 1})
        assert type(plain["loss"]) is torch.Tensor and plain["other"] == 1
        plain["loss"].backward()
    reference = logits.detach().clone().requires_grad_()
    F.cross_entropy(reference, labels).backward()
    # torch's vocabulary-parallel log-softmax sums in another order (2.11: the last bit differs; 2.13: equal)
    assert torch.allclose(plain["loss"].detach(), F.cross_entropy(reference.detach(), labels), rtol=0, atol=1e-6)
    assert torch.allclose(logits.grad, reference.grad, atol=1e-7)
    assert step.plain_loss(reference) is reference


def test_another_use_of_the_sharded_logits_fails_naming_loss_parallel(gloo_world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    sharded = DTensor.from_local(torch.randn(4, 5), mesh, [Shard(-1)])
    with pytest.raises(step.LossParallelError) as error, step.around_step("model.head"):
        _ = sharded + torch.ones(4, 5)
    message = str(error.value)
    assert "`loss_parallel=True`" in message and "'model.head'" in message and "full_tensor()" in message
    with pytest.raises(KeyError), step.around_step("model.head"):  # an error of another kind passes unchanged
        raise KeyError("x")


def test_the_step_runs_its_context_and_its_output_part_only_under_loss_parallel():
    """`STEP`, the binding the list of steps walks: its result is the output layer's name (applied by the
    tensor-parallel step), and with none it does nothing around a step, its backward or its output."""
    from lightning_dpar.plan import ModulePlan
    from lightning_dpar.steps.contract import Applying

    assert isinstance(PlanOptions("S"), step.PlanOptionsRead)
    plan = ModulePlan({}, [], [], loss_parallel="head")
    assert isinstance(plan, step.ModulePlanRead)
    assert step.STEP.apply(Tiny(), plan, Applying(meshes=None)) == "head"  # type: ignore[arg-type]
    parts = (step.STEP.around_step, step.STEP.around_backward, step.STEP.step_output)
    assert all(part is not None and part(None) is None for part in parts)
    assert step.STEP.step_output("head") is step.plain_loss  # type: ignore[misc]
    with pytest.raises(step.LossParallelError, match="'head'"):
        with step.STEP.around_backward("head")():  # type: ignore[misc]
            raise RuntimeError("a DTensor op not supported")
