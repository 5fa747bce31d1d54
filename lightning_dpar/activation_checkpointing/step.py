"""Activation checkpointing as one step of the parallelisation (`STEP`, in `lightning_dpar.parallel.parallelize.STEPS`
after context parallelism, whose checkpoint contexts it takes, and before compile): its slice of the plan
(`plan_activation_checkpointing`) and how it is applied (`apply_activation_checkpointing`). Everything else outside
this folder knows of it is its option (`activation_checkpointing=`) and the policy in the plan, which the activation
estimate traces and the layout search's cost model counts."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Union, runtime_checkable

from torch import nn

from lightning_dpar._private_api import checkpoint_activations
from lightning_dpar.activation_checkpointing.policy import ContextFn, checkpoint_context_fn, checkpoint_forward
from lightning_dpar.context_parallel import step as context_parallel_step
from lightning_dpar.steps.contract import Applying, Planning, Step

__all__ = [
    "CHECKPOINTING_SETTINGS",
    "STEP",
    "ActivationCheckpointingPlan",
    "ActivationCheckpointingSetting",
    "CheckpointPolicyName",
    "Checkpointing",
    "ModelFactsRead",
    "ModulePlanRead",
    "apply_activation_checkpointing",
    "checkpointing_of",
    "plan_activation_checkpointing",
]

#: How a checkpointed block is recomputed: `"full"` (its whole forward again; `activation_checkpointing=True`) or
#: `"selective"` (only the ops the op-level policy does not keep; `activation_checkpointing="selective"`).
CheckpointPolicyName = Literal["full", "selective"]

#: The strategies' `activation_checkpointing` argument: `False`, `True` (full), `"selective"`, or class names /
#: module-name globs (full, on the modules they match).
ActivationCheckpointingSetting = Union[bool, Literal["selective"], Sequence[Union[str, type]]]

#: Which checkpointing a figure or a layout is for, as estimates and the layout search name it: `False` (none),
#: `True` (full) or `"selective"`; on the strategies it is the `activation_checkpointing` argument itself.
Checkpointing = Union[bool, Literal["selective"]]
#: Every setting, from the most activation memory to the least: none, selective, full.
CHECKPOINTING_SETTINGS: tuple[Checkpointing, ...] = (False, "selective", True)


def checkpointing_of(modules: Sequence[str], policy: CheckpointPolicyName) -> Checkpointing:
    """The setting a plan with these checkpointed `modules` and `policy` trains with."""
    if not modules:
        return False
    return "selective" if policy == "selective" else True


@dataclass(frozen=True)
class ActivationCheckpointingPlan:
    """The modules whose activations are recomputed in backward, in module order (empty: none), and how
    (`policy`)."""

    modules: list[str] = field(default_factory=list)
    policy: CheckpointPolicyName = "full"


def plan_activation_checkpointing(
    module: nn.Module,
    setting: Any,
    select: Callable[[Any], list[str]],
    strategy: str,
) -> ActivationCheckpointingPlan:
    """The step's slice of the plan from the strategy's `activation_checkpointing` argument: `False` (none), `True`
    (full, on the blocks `select(True)` names: the FSDP units, or the repeated blocks), `"selective"` (the same
    blocks with the op-level policy), or class names / module-name globs (full, on the modules `select` matches).
    Any other value is refused here, before any collective, naming the valid ones."""
    if setting is None or setting is False:
        return ActivationCheckpointingPlan()
    if setting is True or setting == "selective":
        policy: CheckpointPolicyName = "selective" if setting == "selective" else "full"
        return ActivationCheckpointingPlan(select(True), policy)
    if isinstance(setting, (str, bytes)) or not isinstance(setting, Sequence):
        raise ValueError(
            f"`{strategy}(activation_checkpointing={setting!r})` is not a checkpointing setting. Give `True` (each"
            " block recomputed whole), `'selective'` (each block's matmul and attention outputs kept, only the cheap"
            f" ops recomputed), `False`, or a list of class names / module-name globs (e.g. [{_example(module)!r}])."
        )
    return ActivationCheckpointingPlan(select(list(setting)), "full")


def _example(module: nn.Module) -> str:
    names = [type(child).__name__ for _, child in module.named_modules() if len(list(child.children())) > 0]
    return names[-1] if names else "Block"


def apply_activation_checkpointing(
    root: nn.Module, part: ActivationCheckpointingPlan, context_fn: ContextFn | None = None
) -> None:
    """Recompute each of `part.modules`' activations in backward instead of storing them, all of them or, under the
    selective policy, all but the kept ops' outputs; no wrapper module, so names and checkpoint keys are unchanged.
    Full checkpointing is torch's composable `checkpoint` (the module's call recomputed); selective checkpointing
    checkpoints the module's `forward` (`policy.checkpoint_forward`: the policy's replay needs the same ops in
    forward and recomputation, so the module's hooks stay outside both). `context_fn` gives another step's context
    managers around a block's forward and its recomputation (context parallelism's), entered around the policy's."""
    if part.policy == "selective":
        combined = checkpoint_context_fn(True, context_fn)
        assert combined is not None
        for fqn in part.modules:
            checkpoint_forward(root.get_submodule(fqn), combined)
        return
    options = {} if context_fn is None else {"context_fn": context_fn}
    for fqn in part.modules:
        checkpoint_activations(root.get_submodule(fqn), **options)


@runtime_checkable
class ModelFactsRead(Protocol):
    """What the activation-checkpointing step reads of the model's facts (`ModelFacts`): its slice, found with the
    facts (`plan_activation_checkpointing`) because context parallelism checks it cuts no block."""

    @property
    def checkpointing(self) -> ActivationCheckpointingPlan: ...


@runtime_checkable
class ModulePlanRead(Protocol):
    """What it reads of the plan (`ModulePlan`) when it applies it: its slice."""

    @property
    def activation_checkpointing(self) -> list[str]: ...

    @property
    def activation_checkpointing_policy(self) -> CheckpointPolicyName: ...


def _plan(planning: Planning) -> Mapping[str, Any]:
    facts: ModelFactsRead = planning.facts
    part = facts.checkpointing
    return {"activation_checkpointing": list(part.modules), "activation_checkpointing_policy": part.policy}


def _apply(root: nn.Module, plan: ModulePlanRead, applying: Applying) -> None:
    part = ActivationCheckpointingPlan(plan.activation_checkpointing, plan.activation_checkpointing_policy)
    apply_activation_checkpointing(root, part, context_parallel_step.checkpoint_contexts(applying.results))


#: Activation checkpointing: after context parallelism (whose checkpoint contexts it takes), before compile.
STEP = Step("activation checkpointing", _plan, _apply)
