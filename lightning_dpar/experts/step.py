"""Expert parallelism as one step of the parallelisation (`STEP`, in `lightning_dpar.parallel.parallelize.STEPS` after
loss parallelism and before context parallelism): its slice of the plan (the experts modules, found once with the
model's facts by `lightning_dpar.experts.plan.plan_experts`, since tensor parallelism and float8 leave them out) and
how it is applied (`lightning_dpar.experts.parallel.apply_expert_parallel` over the expert mesh)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from torch import nn

from lightning_dpar.experts.parallel import apply_expert_parallel
from lightning_dpar.plan import ModulePlan
from lightning_dpar.steps.contract import Applying, Planning, Step

__all__ = ["STEP", "ModelFactsRead"]


@runtime_checkable
class ModelFactsRead(Protocol):
    """What the expert-parallel step reads of the model's facts (`ModelFacts`): the experts modules."""

    @property
    def experts(self) -> list[str]: ...


def _plan(planning: Planning) -> Mapping[str, Any]:
    facts: ModelFactsRead = planning.facts  # found with the facts: tensor parallelism leaves them out
    return {"experts": list(facts.experts)}


def _apply(root: nn.Module, plan: ModulePlan, applying: Applying) -> None:
    if plan.experts:
        assert applying.meshes.expert is not None, "an expert-parallel plan needs the expert mesh"
        apply_expert_parallel(root, applying.meshes.expert, plan.experts)


#: Expert parallelism: after tensor and loss parallelism, before context parallelism.
STEP = Step("expert parallel", _plan, _apply)
