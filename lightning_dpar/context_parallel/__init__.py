"""Context parallelism: each sequence split between ranks (`context_parallel_size`); see docs/context_parallel.md.

- `layout`: the head-tail (zig-zag) split and the per-rank attention work it balances;
- `exchange`: the collectives (hidden states split and gathered at the blocks, keys and values all-gathered) as
  autograd functions over public `torch.distributed` calls;
- `attention`: `scaled_dot_product_attention` intercepted (a `TorchFunctionMode`) and made context-parallel;
- `runtime`: the hooks on the model's repeated blocks that split the sequence and gather it back;
- `checks`: what is refused, before the first collective (a pipeline split cutting a block included), and which
  blocks each pipeline stage runs.

`cost`: the sizes it offers and what it costs a layout in the layout search.
"""

from lightning_dpar.context_parallel.checks import (
    block_runs,
    check_batch,
    check_checkpointed_modules,
    check_model,
    check_pipeline_split,
    check_settings,
    sequence_blocks,
)
from lightning_dpar.context_parallel.layout import HeadTailLayout, attention_work, cpu_mask_bytes, key_value_sends
from lightning_dpar.context_parallel.runtime import ContextParallel

__all__ = [
    "ContextParallel",
    "HeadTailLayout",
    "attention_work",
    "block_runs",
    "check_batch",
    "check_checkpointed_modules",
    "check_model",
    "check_pipeline_split",
    "check_settings",
    "cpu_mask_bytes",
    "key_value_sends",
    "sequence_blocks",
]
