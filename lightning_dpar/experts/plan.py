"""Which modules hold a Mixture-of-Experts layer's experts, found once and checked before any collective.

Expert parallelism splits each experts module's experts between the `expert` ranks of the mesh. It needs a module
that keeps the router's choices apart from the expert computation. The contract, which transformers 5's MoE models
(Qwen3-MoE, Mixtral, DeepSeek-V3, gpt-oss, OLMoE, ...) follow with their `mlp.experts` modules, and which a model of
your own follows with a few lines:

- the module has an integer attribute `num_experts`;
- each parameter registered on it has the experts along dim 0 (`gate_up_proj` `[num_experts, 2 * I, H]`), and its
  children hold no parameters;
- `forward(hidden_states, top_k_index, top_k_weights)` takes the tokens `[T, H]`, the expert ids the router chose
  for each token `[T, k]` and their weights `[T, k]`, and returns `sum_j top_k_weights[t, j] * expert_{id}(x_t)`
  `[T, H]`, indexing its parameters by expert id and reading `num_experts` only as the number of experts it holds.

The router stays outside: it runs on each rank's own tokens, as without expert parallelism. The experts modules are,
first found: those named by the strategy's `expert_modules`, those a transformers model's `base_model_ep_plan` marks
`ep_dispatch_experts` (the same precedence as tensor-parallel plans), or every module that follows the contract.
Named ones are checked against it.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

from torch import nn

from lightning_dpar.helpers import class_name, divisors, is_under, show_names
from lightning_dpar.plan.selectors import ModuleSelector, select_modules

__all__ = ["check_experts_contract", "find_experts", "plan_experts"]


def plan_experts(
    root: nn.Module, expert_parallel_size: int, shard_size: int, selectors: Sequence[ModuleSelector] | None
) -> list[str]:
    """The experts modules to split over `expert_parallel_size` ranks (none when it is 1), each checked against the
    contract and the size. A size with no experts module to split is refused: it would silently train as FSDP."""
    if expert_parallel_size == 1:
        return []
    experts = select_modules(root, selectors, "expert_modules") if selectors is not None else find_experts(root)
    if not experts:
        raise ValueError(
            f"`expert_parallel_size={expert_parallel_size}` needs Mixture-of-Experts layers, but {class_name(root)}"
            " holds no experts module: a module with an integer `num_experts`, parameters stacked along the expert"
            " dim, and `forward(hidden_states, top_k_index, top_k_weights)` (see `lightning_dpar.experts.plan`)."
            " Set `expert_parallel_size=1`, or name your experts modules with `expert_modules=[...]`."
        )
    for fqn in experts:
        check_experts_contract(root.get_submodule(fqn), fqn)
        _check_divisible(root.get_submodule(fqn), fqn, expert_parallel_size, shard_size)
    return experts


def find_experts(root: nn.Module) -> list[str]:
    """The modules that follow the experts contract, outermost first (a match's descendants are not searched)."""
    found: list[str] = []
    for fqn, module in root.named_modules():
        if fqn and not is_under(fqn, found) and _contract_violation(module) is None:
            found.append(fqn)
    return found


def check_experts_contract(module: nn.Module, fqn: str) -> None:
    """Refuse a module named as experts that does not follow the contract, saying which part it breaks."""
    violation = _contract_violation(module)
    if violation is not None:
        raise ValueError(
            f"{fqn!r} ({class_name(module)}) cannot be split between expert-parallel ranks: {violation}. An experts"
            " module has an integer `num_experts`, parameters stacked along dim 0 (one slice per expert), no"
            " parameters in its children, and `forward(hidden_states, top_k_index, top_k_weights)`; see"
            " `lightning_dpar.experts.plan`."
        )


def _contract_violation(module: nn.Module) -> str | None:
    num_experts = getattr(module, "num_experts", None)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        return f"its `num_experts` is {num_experts!r}, not a positive integer"
    own = dict(module.named_parameters(recurse=False))
    if not own:
        return "it registers no parameters of its own"
    stacked = {name: tuple(p.shape) for name, p in own.items() if p.ndim < 2 or p.shape[0] != num_experts}
    if stacked:
        return f"parameters {stacked} do not have the {num_experts} experts along dim 0"
    children = [name for name, child in module.named_children() if any(True for _ in child.parameters())]
    if children:
        return f"its children {show_names(children)} hold parameters"
    if not _takes_three_inputs(module):
        return "its `forward` does not take `(hidden_states, top_k_index, top_k_weights)`"
    return None


def _takes_three_inputs(module: nn.Module) -> bool:
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):  # a builtin or C forward: nothing to read, trust the name
        return True
    parameters = list(signature.parameters.values())
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return True
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters) >= 3


def _check_divisible(module: nn.Module, fqn: str, expert_parallel_size: int, shard_size: int) -> None:
    num_experts: int = module.num_experts  # type: ignore[assignment]
    if num_experts % expert_parallel_size:
        valid = [size for size in divisors(num_experts) if shard_size % size == 0]
        raise ValueError(
            f"`expert_parallel_size={expert_parallel_size}` does not divide the {num_experts} experts of {fqn!r}"
            f" ({class_name(module)}): each expert-parallel rank holds the same number of experts. Valid sizes on"
            f" this mesh: {valid}."
        )
