"""Loss parallel as one step of the parallelisation (`STEP`, in `lightning_dpar.parallel.parallelize.STEPS` right after
tensor parallelism, whose resolved styles it reads): its slice of the plan (`plan_loss_parallel`: the output layer whose
logits stay sharded over the vocabulary, with every refusal before any collective), how it is applied
(`sharded_output_styles`, which the tensor-parallel step applies in place of the plan's gathered style, and the
estimate traces), and what it does around each step's forward and backward (`around_step`: torch's
`loss_parallel()` context, which computes `F.cross_entropy` on vocabulary-sharded logits with three small
all-reduces instead of one all-gather of the whole logits; `plain_loss` on the step's output). Everything else
outside this folder knows of it is its option (`loss_parallel=`) and its `ModulePlan` field (`loss_parallel`, the
output layer's name)."""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import Any, Protocol, runtime_checkable

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, loss_parallel

from lightning_dpar.helpers import class_name, show_names, transformers_models
from lightning_dpar.parallel_dims import ParallelDims
from lightning_dpar.steps.contract import Applying, Planning, Step, StepOutput

__all__ = [
    "STEP",
    "LossParallelError",
    "ModulePlanRead",
    "PlanOptionsRead",
    "around_step",
    "gathers_columns",
    "layout_refusal",
    "output_layer_candidate",
    "plain_loss",
    "plan_loss_parallel",
    "sharded_output_styles",
]


@runtime_checkable
class PlanOptionsRead(Protocol):
    """What the loss-parallel step reads of the strategy's `PlanOptions`: its option and the strategy's name
    (refusals name the call)."""

    @property
    def loss_parallel(self) -> bool: ...

    @property
    def strategy(self) -> str: ...


@runtime_checkable
class ModulePlanRead(Protocol):
    """What it reads of the plan (`ModulePlan`) when it applies it: its slice, the output layer's name."""

    @property
    def loss_parallel(self) -> str | None: ...


#: How a user writes the output layer's style in a `tp_plan` so that loss parallel can keep its output sharded.
_GATHERED_STYLE_NAME = "colwise_gather_output"


def gathers_columns(style: ParallelStyle) -> bool:
    """Whether `style` is torch's column-wise style with its output gathered whole on every tensor-parallel rank
    (`colwise_gather_output`, `colwise_rep`, `ColwiseParallel(output_layouts=Replicate())`): what an output layer
    gets without loss parallel, and what loss parallel turns into a vocabulary-sharded output."""
    return type(style) is ColwiseParallel and Replicate() in style.output_layouts


def output_layer_candidate(module: nn.Module) -> str | None:
    """The module that most likely computes `module`'s logits, to name in a refusal: the output embeddings of the
    transformers model it holds (`get_output_embeddings()`, `lm_head`), else its last `nn.Linear` in registration
    order; `None` if it has neither."""
    names = {id(child): fqn for fqn, child in module.named_modules()}
    for _, model in transformers_models(module):
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is not None and id(head) in names:
            return names[id(head)]
    linears = [fqn for fqn, child in module.named_modules() if isinstance(child, nn.Linear)]
    return linears[-1] if linears else None


def layout_refusal(dims: ParallelDims, call: str) -> str | None:
    """Why a layout of `dims` cannot run loss parallel (`call`: how the user asked for it, for the message), or
    `None`: it needs tensor parallelism, and neither pipeline nor context parallelism (not implemented). The step
    raises it; the layout search runs loss parallel exactly where it is `None`."""
    if dims.tensor_parallel == 1:
        return (
            f"{call} with `tensor_parallel_size=1`: loss parallel keeps the output layer's logits sharded over the"
            " vocabulary between tensor-parallel ranks, so it needs `tensor_parallel_size` > 1. Set"
            " `tensor_parallel_size=2` (or more) with a `tp_plan` giving the output layer 'colwise_gather_output',"
            " or drop `loss_parallel=True`."
        )
    for name, size, why in (
        ("pipeline_parallel_size", dims.pipeline, "the loss runs inside the pipeline schedule's last stage"),
        ("context_parallel_size", dims.context, "the logits would be split over the sequence as well"),
    ):
        if size > 1:
            return (
                f"{call} with `{name}={size}` is not supported: {why}, which torch's `loss_parallel()` is not wired"
                f" into here. Use `loss_parallel=False` with `{name}={size}`, or `{name}=1`."
            )
    return None


def plan_loss_parallel(
    module: nn.Module, dims: ParallelDims, enabled: bool, styles: Mapping[str, ParallelStyle], strategy: str
) -> str | None:
    """The step's slice of the plan: the output layer whose logits stay sharded over the vocabulary (`None` without
    `loss_parallel=True`), found in the tensor-parallel step's resolved `styles` as the one module given a
    column-wise style with its output gathered. Refused here, before any collective, each naming the value, what is
    valid and the fix: loss parallel without tensor parallelism, with pipeline or context parallelism (not
    implemented), and with no such module, or several."""
    if not enabled:
        return None
    call = f"`{strategy}(loss_parallel=True)`"
    refusal = layout_refusal(dims, call)
    if refusal is not None:
        raise ValueError(refusal)
    gathered = [fqn for fqn, style in styles.items() if gathers_columns(style)]
    if len(gathered) == 1:
        return gathered[0]
    if gathered:
        raise ValueError(
            f"{call} keeps one output layer's logits sharded, but the `tp_plan` gathers the column-wise output of"
            f" {show_names(gathered)}. Give the gathered column-wise style ('{_GATHERED_STYLE_NAME}') to the output"
            " layer only, or drop `loss_parallel=True`."
        )
    candidate = output_layer_candidate(module)
    if candidate is None:
        raise ValueError(
            f"{call} needs an output layer (an `nn.Linear` producing the logits), and {class_name(module)} has none."
            " Drop `loss_parallel=True`."
        )
    style = styles.get(candidate)
    now = "has no tensor-parallel style" if style is None else f"is {type(style).__name__} in the `tp_plan`"
    if isinstance(style, ColwiseParallel):
        now += " with its output left sharded as local tensors"
    raise ValueError(
        f"{call} needs the output layer column-parallel with its output gathered, which loss parallel then keeps"
        f" sharded over the vocabulary; the output layer {candidate!r} {now}. Give it '{_GATHERED_STYLE_NAME}' in the"
        f" `tp_plan` (`tp_plan={{..., {candidate!r}: {_GATHERED_STYLE_NAME!r}}}`), or drop `loss_parallel=True`."
    )


def sharded_output_styles(styles: Mapping[str, ParallelStyle], output_layer: str | None) -> dict[str, ParallelStyle]:
    """`styles` with `output_layer`'s gathered column-wise style made vocabulary-sharded: torchtitan's
    `ColwiseParallel(input_layouts=..., output_layouts=Shard(-1), use_local_output=False)`, so the logits leave the
    layer as a DTensor that torch's `loss_parallel()` understands. Unchanged when `output_layer` is `None`."""
    if output_layer is None:
        return dict(styles)
    gathered = styles[output_layer]
    assert isinstance(gathered, ColwiseParallel), "planned as a gathered column-wise style"
    sharded = ColwiseParallel(input_layouts=gathered.input_layouts[0], output_layouts=Shard(-1), use_local_output=False)
    return {**styles, output_layer: sharded}


def plain_loss(output: Any) -> Any:
    """A training step's output with its loss as a plain tensor: torch's `loss_parallel()` returns the loss as a
    DTensor replicated on every tensor-parallel rank, whose local tensor is the whole value (differentiable: its
    backward hands the gradient back to the DTensor). Lightning's closure, logging and the non-finite guard's
    collectives then see an ordinary scalar. Anything else passes through unchanged."""
    if isinstance(output, DTensor) and all(p.is_replicate() for p in output.placements):
        return output.to_local()
    if isinstance(output, dict) and "loss" in output:
        return {**output, "loss": plain_loss(output["loss"])}
    return output


class LossParallelError(RuntimeError):
    """A use of the vocabulary-sharded logits that torch's `loss_parallel()` does not support, raised at its first
    use on every tensor-parallel rank alike (all of them run the same step)."""


@contextmanager
def around_step(output_layer: str, training: bool = True, args: Sequence[Any] = ()) -> Generator[None, None, None]:
    """Around each step's forward, and around its backward (torch requires both inside the context): torch's
    `loss_parallel()`. An error of DTensor's from a use of the sharded logits that is not a cross-entropy
    (label smoothing, `argmax`, a metric, mixing them with plain tensors) is raised again naming loss parallel, the
    output layer and the fix."""
    try:
        with loss_parallel():
            yield
    except Exception as error:
        if "DTensor" not in str(error) and "loss_parallel" not in str(error):
            raise
        raise LossParallelError(
            f"Under `loss_parallel=True` the output layer {output_layer!r} returns its logits as a DTensor sharded"
            " over the vocabulary, and torch's `loss_parallel()` computes only `F.cross_entropy` /"
            " `nn.CrossEntropyLoss` on them, without `label_smoothing` (class-index targets, reduction 'mean',"
            f" 'sum' or 'none'). This step used them otherwise: {error}. Compute the loss with `F.cross_entropy`"
            " and `label_smoothing=0`; for any other use of the logits (argmax, metrics, logging) gather them first"
            " with `logits.full_tensor()`; to add a plain tensor to the loss (an auxiliary loss), take the loss's"
            " whole value with `loss.to_local()` (differentiable); or set `loss_parallel=False`."
        ) from error


def _plan(planning: Planning) -> Mapping[str, Any]:
    """The output layer whose logits stay sharded, found in the tensor-parallel step's resolved styles."""
    options: PlanOptionsRead = planning.options
    styles = planning.slices["tensor_parallel"]
    output = plan_loss_parallel(planning.module, planning.dims, options.loss_parallel, styles, options.strategy)
    return {"loss_parallel": output}


def _apply(root: nn.Module, plan: ModulePlanRead, applying: Applying) -> str | None:
    """Its style was applied with tensor parallelism's (one `parallelize_module` call, ties kept); what remains is
    the context around each step, so its result is the output layer's name (`None`: no loss parallel)."""
    return plan.loss_parallel


def _around_each(output_layer: str | None) -> Callable[..., AbstractContextManager[None]] | None:
    """torch's `loss_parallel()` around each step's forward and around its backward; nothing without it."""
    return None if output_layer is None else partial(around_step, output_layer)


def _step_output(output_layer: str | None) -> StepOutput | None:
    return None if output_layer is None else plain_loss


#: Loss parallel: right after tensor parallelism, which applies its style.
STEP = Step("loss parallel", _plan, _apply, _around_each, _around_each, _step_output)
