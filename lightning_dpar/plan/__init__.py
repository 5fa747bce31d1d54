"""Parallelism plans as data: which module gets which tensor-parallel style, which blocks become FSDP units, which
get activation checkpointing and `compile`, and how a pipelined model splits into stages.

Modules, in the order planning uses them:

- `structure`: facts read off the model once (repeated blocks, top-level units, already parallelised?);
- `selectors`: choosing modules by name glob or class (`shard_modules`, `activation_checkpointing`);
- `styles`: the one registry of tensor-parallel style names (ours and transformers'), and `tp_plan` parsing;
- `transformers`: the plan a transformers model carries (`tp_plan="auto"`);
- `adapters`: a plan adapted to a peft-wrapped model (entries reach the base layers; LoRA adapters get exact styles);
- `tensor_parallel`: a `tp_plan` resolved against the model, sizes and head counts checked;
- `compile`: which modules `compile` compiles;
- `module_plan`: `ModulePlan`, and the part of it one pipeline rank applies;
- `planner`: `PlanOptions` (a strategy's arguments, frozen), the adoption checks, the tensor-parallel slice and the
  data-parallel settings; `lightning_dpar.parallel.parallelize.plan_modules` walks the steps that make the plan.

Everything here is validated against the module tree alone, before any process-group work, so a bad plan fails the
same way (and with the same message) in training, on every rank, and in the `plan` dry run.
"""

from lightning_dpar.plan.module_plan import ModulePlan, local_plan
from lightning_dpar.plan.planner import PlanOptions
from lightning_dpar.plan.selectors import (
    ModuleSelector,
    fqn_matches,
    resolve_activation_checkpointing,
    resolve_blocks,
    select_modules,
)
from lightning_dpar.plan.structure import repeated_blocks
from lightning_dpar.plan.styles import (
    AUTO,
    HF_STYLES,
    STYLE_NAMES,
    STYLES,
    NamedStyle,
    PlanStyle,
    StyleSpec,
    TPPlanSpec,
    parse_tp_plan,
)
from lightning_dpar.plan.tensor_parallel import TensorParallelSizeError, resolve_tp_plan, tensor_parallel_size_fix
from lightning_dpar.plan.transformers import transformers_tp_plan

__all__ = [
    "AUTO",
    "HF_STYLES",
    "STYLES",
    "STYLE_NAMES",
    "ModulePlan",
    "ModuleSelector",
    "NamedStyle",
    "PlanOptions",
    "PlanStyle",
    "StyleSpec",
    "TPPlanSpec",
    "TensorParallelSizeError",
    "fqn_matches",
    "local_plan",
    "parse_tp_plan",
    "repeated_blocks",
    "resolve_activation_checkpointing",
    "resolve_blocks",
    "resolve_tp_plan",
    "select_modules",
    "tensor_parallel_size_fix",
    "transformers_tp_plan",
]
