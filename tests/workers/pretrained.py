"""Pretrained Hugging Face weights through real Trainers: loaded into shards under every strategy (exactly the
`from_pretrained` values), fine-tuned (parity with single-process training from the same weights), exported back
with `consolidate --format hf`, key mismatches refused, and the memory a rank needs while loading.

The pretrained directories are written by the pytest side (`tests/launched/test_pretrained.py`) next to the results
file.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, PretrainedWeights, ReplicateStrategy
from lightning_dpar.hf_weights.pretrained import PretrainedLoadError, load_pretrained
from tests.support.models import Net, RegressionData
from tests.workers.cases import Case, one_case
from tests.workers.common import full_params, trainer_for, world_size

BATCH = 2
STEPS = 3
SEQ = 8
LR = 1e-3  # fine-tuning scale; Adam turns fp32 rounding in near-zero gradients into steps of up to LR
#: Torch-style TP plan for Llama (GQA: q/k/v heads split alike, so each rank keeps whole heads and their groups).
LLAMA_TP_PLAN = {
    "model.model.layers.*.self_attn.[qkv]_proj": "colwise",
    "model.model.layers.*.self_attn.o_proj": "rowwise",
    "model.model.layers.*.mlp.[gu][ap]*_proj": "colwise",
    "model.model.layers.*.mlp.down_proj": "rowwise",
}


def workdir() -> Path:
    return Path(sys.argv[2]).resolve().parent


def tiny_dir(untied: bool = False) -> str:
    """The tiny Llama `save_pretrained` directory (with tied embeddings, or without for pipeline stages)."""
    return str(workdir() / ("tiny_llama_untied" if untied else "tiny_llama"))


class TokenData(Dataset):
    def __init__(self, vocab: int, n: int = 32, seed: int = 7) -> None:
        self.ids = torch.randint(0, vocab, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i]


class CausalLM(L.LightningModule):
    """A Hugging Face causal LM held as `self.<attr>`, built from the config with other (random) weights than the
    pretrained ones: only a load that reaches every parameter makes the values match."""

    def __init__(self, path: str, attr: str = "model", tp_plan: dict | None = None, extra: bool = False) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(123)
        self.attr = attr
        setattr(self, attr, AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)))
        if tp_plan is not None:
            self.tp_plan = tp_plan
        if extra:
            self.extra_head = torch.nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        return getattr(self, self.attr)(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.0)


class CaptureStart(Callback):
    """Full parameters right after setup (the pretrained load), before the first step; a collective."""

    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.params = {k: v.clone() for k, v in full_params(trainer).items()}  # replicate: the live tensors


def pretrained_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def reference_train(path: str, data: TokenData, dp: int) -> dict[str, torch.Tensor]:
    """Single-process training from `from_pretrained` on the global batches Lightning's sampler feeds `dp` ranks."""
    model = pretrained_model(path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    per_rank = [list(DistributedSampler(data, num_replicas=dp, rank=r, shuffle=True, seed=0)) for r in range(dp)]
    for step in range(STEPS):
        batch = data.ids[[i for r in range(dp) for i in per_rank[r][step * BATCH : (step + 1) * BATCH]]]
        optimizer.zero_grad()
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], prefix: str) -> float:
    missing = [k for k in want if prefix + k not in got]
    assert not missing, f"not in the trained model: {missing}"
    return max((got[prefix + k] - v).abs().max().item() for k, v in want.items())


def strategy_for(name: str, pretrained) -> L.pytorch.strategies.Strategy:
    if name == "fsdp":
        return FullyShardStrategy(pretrained=pretrained)
    if name == "replicate":
        return ReplicateStrategy(pretrained=pretrained)
    if name == "2d":
        return FSDPTensorParallelStrategy(tensor_parallel_size=2, pretrained=pretrained)
    if name == "2d_auto":  # transformers' own plan: the tied embedding and head share one DTensor
        return FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan="auto", pretrained=pretrained)
    if name == "pp":  # each stage reads only its own layers' weights
        return FullyShardStrategy(pipeline_parallel_size=2, pretrained=pretrained)
    raise ValueError(name)


def fine_tune(name: str, attr: str) -> tuple[L.Trainer, CaptureStart, TokenData]:
    """Fine-tune the tiny Llama (held as `self.<attr>`) from its pretrained weights under strategy `name`."""
    path = tiny_dir(untied=name == "pp")
    module = CausalLM(path, attr=attr, tp_plan=LLAMA_TP_PLAN if name == "2d" else None)
    data = TokenData(getattr(module, attr).config.vocab_size)
    capture = CaptureStart()
    trainer = trainer_for(strategy_for(name, path), max_steps=STEPS, callbacks=[capture])
    trainer.fit(module, DataLoader(data, batch_size=BATCH))
    return trainer, capture, data


def parity_case(name: str, attr: str) -> dict | None:
    """The loaded weights against `from_pretrained`, and the fine-tuned ones against single-process training."""
    trainer, capture, data = fine_tune(name, attr)
    trained = full_params(trainer)
    if trainer.global_rank != 0:
        return None
    path, prefix = tiny_dir(untied=name == "pp"), f"{attr}."
    dp = world_size() // 2 if name in ("2d", "2d_auto", "pp") else world_size()
    return {
        "loaded_max_abs_diff": max_diff(capture.params, pretrained_model(path).state_dict(), prefix),
        "trained_max_abs_diff": max_diff(trained, reference_train(path, data, dp), prefix),
        "random_init_diff": max_diff(
            CausalLM(path, attr=attr).state_dict(), pretrained_model(path).state_dict(), prefix
        ),
    }


def tied_auto_plan_case() -> dict | None:
    """The tied tiny Llama under transformers' own plan (`tp_plan="auto"`): loaded, fine-tuned (as `parity_case`),
    still tied, then saved and exported with `consolidate --format hf`, whose `from_pretrained` ties again."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from lightning_dpar.checkpoint.consolidate import main as consolidate

    trainer, capture, data = fine_tune("2d_auto", attr="model")
    model = trainer.lightning_module.model
    still_tied = model.lm_head.weight is model.model.embed_tokens.weight
    ckpt = workdir() / "tied_auto.ckpt"
    trainer.save_checkpoint(ckpt)
    trained = full_params(trainer)
    if trainer.global_rank != 0:
        return None
    path, out = tiny_dir(), workdir() / "tied_auto_hf"
    code = consolidate([str(ckpt), str(out), "--format", "hf"])
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        exported_keys = sorted(f.keys())
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    return {
        "loaded_max_abs_diff": max_diff(capture.params, pretrained_model(path).state_dict(), "model."),
        "trained_max_abs_diff": max_diff(trained, reference_train(path, data, world_size() // 2), "model."),
        "random_init_diff": max_diff(CausalLM(path).state_dict(), pretrained_model(path).state_dict(), "model."),
        "still_tied": still_tied,
        "export_code": code,
        "exported_keys": exported_keys,
        "export_reties": exported.lm_head.weight is exported.model.embed_tokens.weight,
        "export_max_abs_diff": max_diff(trained, exported.state_dict(), "model."),
    }


def group_pretrained_parity() -> Iterator[Case]:
    world = world_size()
    yield Case(f"pretrained_fsdp_{world}", lambda: parity_case("fsdp", attr="net"))
    yield Case(f"pretrained_replicate_{world}", lambda: parity_case("replicate", attr="model"))
    if world == 4:
        yield Case(f"pretrained_2d_{world}", lambda: parity_case("2d", attr="model"))
        yield Case(f"pretrained_2d_auto_{world}", tied_auto_plan_case)
    yield Case(f"pretrained_pp_{world}", lambda: parity_case("pp", attr="model"))


def errors_case() -> dict | None:
    """A model with a key the checkpoint lacks: strict names it on every rank; non-strict loads the rest."""
    path = tiny_dir()
    data = TokenData(64)
    messages = []
    try:
        trainer_for(FullyShardStrategy(pretrained=path), max_steps=1).fit(
            CausalLM(path, extra=True), DataLoader(data, batch_size=BATCH)
        )
    except PretrainedLoadError as error:
        messages.append(str(error))
    gathered = [None] * world_size()
    dist.all_gather_object(gathered, messages)
    capture = CaptureStart()
    module = CausalLM(path, extra=True)
    extra_before = module.extra_head.weight.detach().clone()
    trainer = trainer_for(
        FullyShardStrategy(pretrained=PretrainedWeights(path, strict=False)), max_steps=1, callbacks=[capture]
    )
    trainer.fit(module, DataLoader(data, batch_size=BATCH))
    if trainer.global_rank != 0:
        return None
    return {
        "strict_messages": gathered,
        "lenient_loaded_diff": max_diff(capture.params, pretrained_model(path).state_dict(), "model."),
        "lenient_extra_kept": (capture.params["extra_head.weight"] - extra_before).abs().max().item(),
    }


class MetaBuilt(L.LightningModule):
    """A model with `reset_parameters` everywhere, built on the meta device, plus a head the checkpoint lacks."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Net()
        self.head = torch.nn.Linear(5, 5)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.head(self.model(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def meta_case() -> dict | None:
    """`empty_init=True`: the strategy materialises the shards (`reset_parameters`), then the pretrained weights
    (one `model.safetensors`) overwrite what the checkpoint has; the head it lacks keeps its initialisation."""
    path = str(workdir() / "net_weights")
    capture = CaptureStart()
    trainer = trainer_for(
        FullyShardStrategy(pretrained=PretrainedWeights(path, strict=False)), max_steps=1, callbacks=[capture]
    )
    with trainer.init_module(empty_init=True):
        module = MetaBuilt()
    built_on_meta = all(p.is_meta for p in module.parameters())
    trainer.fit(module, DataLoader(RegressionData(), batch_size=BATCH))
    ckpt = workdir() / "not_hf.ckpt"
    trainer.save_checkpoint(ckpt)  # no PreTrainedModel inside: `--format hf` must refuse it
    if trainer.global_rank != 0:
        return None
    from safetensors.torch import load_file

    from lightning_dpar.checkpoint.consolidate import main as consolidate

    head = capture.params["head.weight"]
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = consolidate([str(ckpt), str(workdir() / "not_hf"), "--format", "hf"])
    return {
        "built_on_meta": built_on_meta,
        "loaded_max_abs_diff": max_diff(capture.params, load_file(f"{path}/model.safetensors"), "model."),
        "head_finite_nonzero": bool(torch.isfinite(head).all() and head.abs().sum() > 0),
        "hf_export_code": code,
        "hf_export_error": stderr.getvalue(),
        "hf_export_wrote": (workdir() / "not_hf").exists(),
    }


def export_case() -> dict | None:
    """Fine-tune from pretrained weights under FSDP (the model held as `self.net`), save a sharded checkpoint, and
    export it with `consolidate --format hf` and `--format safetensors --strip-prefix net.`."""
    from lightning_dpar.checkpoint.consolidate import main as consolidate

    trainer, _, _ = fine_tune("fsdp", attr="net")
    ckpt = workdir() / "export.ckpt"
    trainer.save_checkpoint(ckpt)
    trained = full_params(trainer)
    if trainer.global_rank != 0:
        return None
    out, plain = workdir() / "export_hf", workdir() / "export_st"
    codes = [
        consolidate([str(ckpt), str(out), "--format", "hf", "--max-shard-size", "20KB"]),
        consolidate([str(ckpt), str(plain), "--format", "safetensors", "--strip-prefix", "net."]),
    ]
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    return {
        "codes": codes,
        "files": sorted(os.listdir(out)),
        "missing": sorted(info["missing_keys"]),
        "unexpected": sorted(info["unexpected_keys"]),
        "max_abs_diff": max_diff(trained, model.state_dict(), "net."),
        "strip_prefix_keys": sorted(load_file(plain / "model.safetensors")),
        "model_keys": sorted(model.state_dict()),
    }


def vm_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


class MeasureLoad(Callback):
    """Once the model is set up (sharded, optimizer built): reset this process's RSS high-water mark, load the
    pretrained weights the way the strategy does, and report the peak increase over the RSS before loading."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.report: dict = {}

    def on_train_start(self, trainer, pl_module) -> None:
        local = sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in pl_module.parameters()
        )
        dist.barrier()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)
        baseline = vm_kib("VmRSS")
        load_pretrained(pl_module, PretrainedWeights(self.path))
        peak = vm_kib("VmHWM")
        self.report = {"baseline_kib": baseline, "peak_kib": peak, "increase_bytes": (peak - baseline) * 1024}
        self.report["rank_share_bytes"] = local
        trainer.should_stop = True


def memory_case() -> list | None:
    path = str(workdir() / "big_llama")
    measure = MeasureLoad(path)
    trainer = trainer_for(FullyShardStrategy(), max_steps=1, callbacks=[measure])
    trainer.fit(CausalLM(path), DataLoader(TokenData(64), batch_size=BATCH))
    reports = [None] * world_size()
    dist.all_gather_object(reports, measure.report)
    return reports if trainer.global_rank == 0 else None


GROUPS = {
    "pretrained_parity": group_pretrained_parity,
    "pretrained_errors": one_case("pretrained_errors", errors_case),
    "pretrained_meta": one_case("pretrained_meta", meta_case),
    "pretrained_export": one_case("pretrained_export", export_case),
    "pretrained_memory": one_case("pretrained_memory", memory_case),
}
