"""transformers models through real Trainers: a tiny Llama with grouped-query attention (4 query heads, 2 key/value
heads) held under a LightningModule attribute that is not `model`, trained with its own tensor-parallel plan
(`tp_plan="auto"`) and with every strategy, and built on the meta device and materialised shard by shard. Each case
ends with the same parameters as single-process training of the same model."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator

import lightning as L
import torch
from torch.utils.data import Dataset

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, ReplicateStrategy
from tests.support.hf_configs import decoder_config
from tests.workers.cases import Case
from tests.workers.common import BATCH, STEPS, full_params, trainer_for, world_size

VOCAB, SEQ, SEED = 64, 8, 1234
#: FSDP's warning about a unit returning a view, which every tensor-parallel HF model's gathered logits raised.
VIEW_WARNING = "returned a view tensor"


def llama_config(tied: bool = False):
    return decoder_config(vocab_size=VOCAB, max_position_embeddings=SEQ, tie_word_embeddings=tied)


class TokenIds(Dataset):
    """`n` random sequences of `SEQ` token ids below `VOCAB`, the same for every `seed`."""

    def __init__(self, n: int = 64, seed: int = 3) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i]


class LlamaModule(L.LightningModule):
    tied = False

    def __init__(self, build_seed: int | None = 0) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        if build_seed is not None:
            torch.manual_seed(build_seed)
        self.net = LlamaForCausalLM(llama_config(tied=self.tied))

    def training_step(self, batch, batch_idx):
        return self.net(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        # SGD: the parameters move by lr x gradient, so the comparison measures the gradients. (Adam's first steps
        # are about lr x sign(gradient), which turns float noise in a near-zero gradient into a difference of lr.)
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class TiedLlamaModule(LlamaModule):
    """`tie_word_embeddings=True`: `lm_head.weight` is `model.embed_tokens.weight`, which transformers' plan shards
    with `embedding_rowwise` and `colwise_gather_output` (both dim 0 of the `[vocab, hidden]` weight)."""

    tied = True


class DeepLlamaModule(LlamaModule):
    """4 decoder layers: one per stage of a 2-rank pipeline with 2 stages per rank."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        config = llama_config()
        config.num_hidden_layers = 4
        self.net = LlamaForCausalLM(config)


class Qwen3Module(LlamaModule):
    """Qwen3: per-head `q_norm` / `k_norm` in its plan as `replicated_with_grad_allreduce`."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        from transformers import Qwen3ForCausalLM

        torch.manual_seed(0)
        config = decoder_config("Qwen3Config", vocab_size=VOCAB, head_dim=8, max_position_embeddings=SEQ)
        self.net = Qwen3ForCausalLM(config)


def global_batches(data: Dataset, dp: int, seed: int, steps: int = STEPS) -> list[torch.Tensor]:
    """What Lightning's distributed sampler (shuffled with the global seed) feeds `dp` ranks, one batch per step."""
    from torch.utils.data import DistributedSampler

    per_rank = [list(DistributedSampler(data, num_replicas=dp, rank=r, shuffle=True, seed=seed)) for r in range(dp)]
    return [
        torch.stack([data[i] for r in range(dp) for i in per_rank[r][s * BATCH : (s + 1) * BATCH]])
        for s in range(steps)
    ]


def reference(module: LlamaModule, data: Dataset, dp: int, seed: int) -> dict[str, torch.Tensor]:
    optimizer = module.configure_optimizers()
    for batch in global_batches(data, dp, seed):
        optimizer.zero_grad()
        module.training_step(batch, 0).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def initialised_like_materialisation(seed: int, model=LlamaModule) -> LlamaModule:
    """The whole model on one CPU process, initialised by its own initialiser (`init_weights`, which ties the
    embeddings again after `to_empty`) from `seed`."""
    with torch.device("meta"):
        module = model(build_seed=None)
    module.to_empty(device="cpu")
    torch.manual_seed(seed)
    module.net.init_weights()
    return module


def _diff(got, want) -> float:
    assert set(got) == set(want), (sorted(got), sorted(want))
    return max((got[k] - want[k]).abs().max().item() for k in want)


def parity_case(strategy, dp: int, empty_init: bool = False, model=LlamaModule) -> dict | None:
    """Train under `strategy`; on rank 0, the largest difference to single-process training of the same model."""
    data = TokenIds()
    trainer = trainer_for(strategy)
    try:
        if empty_init:
            with trainer.init_module(empty_init=True):
                module = model(build_seed=None)
            assert all(p.is_meta for p in module.parameters())
            L.seed_everything(SEED)  # the materialisation draws from the seeded global generator (and shuffles with it)
        else:
            module = model()
        params_before = len(list(module.parameters()))
        with warnings.catch_warnings(record=True) as caught:  # the run's other warnings keep their filters
            warnings.filterwarnings("always", message=VIEW_WARNING)
            trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=BATCH))
    finally:
        os.environ.pop("PL_GLOBAL_SEED", None)  # other cases shuffle with Lightning's default seed 0
    local_numel = max(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in module.parameters())
    got = full_params(trainer)
    if trainer.global_rank != 0:
        return None
    want_module = initialised_like_materialisation(SEED, model) if empty_init else model()
    shuffle_seed = SEED if empty_init else 0
    result = {"max_abs_diff": _diff(got, reference(want_module, data, dp, shuffle_seed))}
    result["view_warnings"] = sorted({str(w.message)[:120] for w in caught if VIEW_WARNING in str(w.message)})
    if empty_init:
        result["largest_local_numel"] = local_numel
        result["largest_numel"] = max(p.numel() for p in want_module.parameters())
    if model.tied:
        result["still_tied"] = module.net.lm_head.weight is module.net.model.embed_tokens.weight
        result["params_before_after"] = [params_before, len(list(module.parameters()))]
    return result


def group_hf_llama() -> Iterator[Case]:
    world = world_size()
    yield Case("llama_fsdp", lambda: parity_case(FullyShardStrategy(), world))
    yield Case("llama_replicate", lambda: parity_case(ReplicateStrategy(), world))
    yield Case(
        "llama_2d_auto_plan",
        lambda: parity_case(FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan="auto"), world // 2),
    )
    yield Case(
        "llama_2d_default_plan", lambda: parity_case(FSDPTensorParallelStrategy(tensor_parallel_size=2), world // 2)
    )
    yield Case(
        "qwen3_2d_auto_plan",
        lambda: parity_case(FSDPTensorParallelStrategy(tensor_parallel_size=2), world // 2, model=Qwen3Module),
    )
    # Pipeline: the decoder layers split over 2 stages; embeddings, masks and rotary embeddings as transformers
    # computes them, the loss from `labels` inside the model's forward on the last stage.
    yield Case("llama_pp_1f1b", lambda: parity_case(FullyShardStrategy(pipeline_parallel_size=2), world // 2))
    yield Case(
        "llama_3d" if world == 4 else "llama_pp_zero_bubble",
        lambda: parity_case(
            FSDPTensorParallelStrategy(
                pipeline_parallel_size=2,
                tensor_parallel_size=world // 2,
                pipeline_schedule="ZBVZeroBubble",
                pipeline_stages_per_rank=2,
                pipeline_split=["net.model.layers.1", "net.model.layers.2", "net.model.layers.3"],
            ),
            1,
            model=DeepLlamaModule,
        ),
    )
    # Tied embeddings: the embedding and the head share one DTensor under transformers' plan (both shard the vocab).
    yield Case(
        "tied_llama_2d_auto_plan",
        lambda: parity_case(
            FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan="auto"), world // 2, model=TiedLlamaModule
        ),
    )
    yield Case(
        "tied_llama_meta_init_2d",
        lambda: parity_case(
            FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan="auto"),
            world // 2,
            empty_init=True,
            model=TiedLlamaModule,
        ),
    )
    yield Case("llama_meta_init_fsdp", lambda: parity_case(FullyShardStrategy(), world, empty_init=True))
    yield Case(
        "llama_meta_init_2d",
        lambda: parity_case(FSDPTensorParallelStrategy(tensor_parallel_size=2), world // 2, empty_init=True),
    )


def group_hf_compile_tp() -> Iterator[Case]:
    """`compile=True` under TP 2 with transformers' own plan: the row-wise token embedding runs eagerly and feeds the
    first compiled decoder layer (`lightning_dpar.parallel.parallelize.wait_before_compiled_units`)."""
    world = world_size()

    def compiled_2d(**kwargs):
        return FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan="auto", compile=True, **kwargs)

    yield Case("llama_2d_auto_plan_compiled", lambda: parity_case(compiled_2d(), world // 2))
    yield Case("qwen3_2d_auto_plan_compiled", lambda: parity_case(compiled_2d(), world // 2, model=Qwen3Module))
    yield Case(
        "tied_llama_2d_auto_plan_compiled", lambda: parity_case(compiled_2d(), world // 2, model=TiedLlamaModule)
    )


GROUPS = {"hf_llama": group_hf_llama, "hf_compile_tp": group_hf_compile_tp}
