"""Activation checkpointing: each selected block's activations recomputed in backward instead of kept
(`activation_checkpointing=True`, full), or only its cheap ops recomputed while matmul and attention outputs are
kept (`activation_checkpointing="selective"`, torchtitan's op-level policy); see docs/efficiency.md.

- `policy`: the op-level policy and the checkpoint contexts that apply it, composed with another step's contexts
  (context parallelism's attention interception for the recomputation);
- `step`: the step of the parallelisation: its slice of the plan (`plan_activation_checkpointing`) and how it is
  applied (`apply_activation_checkpointing`).

`estimate`: what a setting keeps in the `plan` dry run; `cost`: the recompute it costs a layout in the layout
search.
"""

from lightning_dpar.activation_checkpointing.policy import (
    SELECTIVE_SAVED_OPS,
    ContextFn,
    checkpoint_context_fn,
    checkpoint_forward,
    selective_policy,
)
from lightning_dpar.activation_checkpointing.step import (
    CHECKPOINTING_SETTINGS,
    ActivationCheckpointingPlan,
    ActivationCheckpointingSetting,
    Checkpointing,
    CheckpointPolicyName,
    apply_activation_checkpointing,
    checkpointing_of,
    plan_activation_checkpointing,
)

__all__ = [
    "CHECKPOINTING_SETTINGS",
    "SELECTIVE_SAVED_OPS",
    "ActivationCheckpointingPlan",
    "ActivationCheckpointingSetting",
    "CheckpointPolicyName",
    "Checkpointing",
    "ContextFn",
    "apply_activation_checkpointing",
    "checkpoint_context_fn",
    "checkpoint_forward",
    "checkpointing_of",
    "plan_activation_checkpointing",
    "selective_policy",
]
