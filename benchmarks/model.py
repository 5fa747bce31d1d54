"""The benchmark model and data: a stack of residual MLP blocks over token sequences (transformer-shaped, so the
blocks are the FSDP units and `fc1`/`fc2` split column/row-wise for tensor parallelism)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.utils.data import Dataset

from lightning_dpar.examples.gpt import Block as GPTBlock
from lightning_dpar.examples.gpt import Decoder


@dataclass(frozen=True)
class Size:
    """Model and batch shape. `kind="mlp"`: residual MLP blocks over float inputs (embeddings already applied);
    `kind="gpt"`: the package's example decoder (`lightning_dpar.examples.gpt.Decoder`: attention, LayerNorm,
    embeddings and LM head) on random token ids; `kind="llama"`: a transformers `LlamaForCausalLM` built from its
    config (`hidden` is its MLP width, `kv_heads` its grouped-query key/value heads, no key/value cache), as a
    user of transformers would train one."""

    dim: int
    hidden: int  # mlp and llama (intermediate size); the GPT's MLP is 4 * dim
    depth: int
    seq: int
    batch: int  # per data-parallel rank
    kind: str = "mlp"
    heads: int = 0  # gpt only
    vocab: int = 0  # gpt and llama
    kv_heads: int = 0  # llama only

    def as_dict(self) -> dict[str, int | str]:
        return asdict(self)

    def describe(self) -> str:
        if self.kind == "llama":
            return (
                f"transformers LlamaForCausalLM, {self.depth} layers, hidden {self.dim}, MLP {self.hidden},"
                f" {self.heads} heads / {self.kv_heads} key-value heads, vocab {self.vocab}"
                f" ({parameter_count(self) / 1e6:,.1f} M parameters)"
            )
        if self.kind == "gpt":
            return (
                f"GPT decoder, {self.depth} layers, dim {self.dim}, {self.heads} heads, vocab {self.vocab}"
                f" ({parameter_count(self) / 1e6:,.1f} M parameters)"
            )
        return f"{self.depth} residual MLP blocks, dim {self.dim}, hidden {self.hidden}"

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 x (parameters that multiply activations; not the embedding lookups), plus,
        for the GPT, attention's 12 x layers x dim x seq (the PaLM paper's count, which ignores causal masking)."""
        if self.kind in ("gpt", "llama"):
            embeddings = self.vocab + (self.seq if self.kind == "gpt" else 0)  # llama: rotary, no position table
            matmul_params = parameter_count(self) - embeddings * self.dim
            return 6.0 * matmul_params + 12.0 * self.depth * self.dim * self.seq
        return 6.0 * parameter_count(self)


@dataclass(frozen=True)
class Preset:
    """A named benchmark configuration: model size, precision, where it runs and which variants it compares."""

    size: Size
    precision: str  # Trainer precision; plain loops do the same (FSDP2 MixedPrecisionPolicy / autocast)
    world_sizes: tuple[int, ...]
    #: Variant families (replicate, fsdp, 2d) and drivers (plain, lightning, dpar) this preset runs.
    families: tuple[str, ...] = ("replicate", "fsdp", "2d")
    drivers: tuple[str, ...] = ("plain", "lightning", "dpar")
    #: Time checkpoint save/load/async save on the eager Lightning variants.
    checkpoints: bool = True
    #: Default measurement: warm-up steps (compilation happens there), timed steps, interleaved repetitions.
    warmup: int = 5
    steps: int = 20
    repeats: int = 3


#: `cpu`: the suite's tiny model, where the fixed cost per step shows (~50-200 ms steps on 2 shared cores).
#: `cpu-large`: steps of ~1 to 3 s on the same machine (2D ~1 s: its two ranks split each matrix product), where
#: the cost proportional to the model shows and the fixed cost per step fades.
#: `gpu`: ~1.1 B-parameter decoder, bf16-mixed, world size 1, FSDP and 2D against the plain FSDP2 loop (one H100/H200;
#: estimated ~35 GB peak: 18 GB of fp32 parameters, gradients and AdamW state, ~11 GB of bf16 activations, ~4 GB
#: of fp32 logits and their gradient).
#: `gpu-smoke`: the `gpu` preset's code path at a size any device runs in seconds (tests use it on CPU).
PRESETS: dict[str, Preset] = {
    "cpu": Preset(Size(dim=256, hidden=1024, depth=4, seq=16, batch=8), "32-true", (2, 4)),
    "cpu-large": Preset(
        Size(dim=512, hidden=0, depth=8, seq=128, batch=4, kind="gpt", heads=8, vocab=256),
        "32-true",
        (2,),
        checkpoints=False,
    ),
    "gpu": Preset(
        Size(dim=2048, hidden=0, depth=20, seq=2048, batch=4, kind="gpt", heads=16, vocab=32000),
        "bf16-mixed",
        (1,),
        families=("fsdp", "2d"),
        drivers=("plain", "dpar"),
        checkpoints=False,
        # 8 variants, 4 of them compiled (recompiled per variant): ~6-8 min on one H100 (a device command may run
        # 10 min); `--repeats 2` for a range across repetitions.
        warmup=3,
        steps=10,
        repeats=1,
    ),
    "gpu-smoke": Preset(
        Size(dim=64, hidden=0, depth=2, seq=32, batch=2, kind="gpt", heads=4, vocab=128),
        "bf16-mixed",
        (1,),
        families=("fsdp", "2d"),
        drivers=("plain", "dpar"),
        checkpoints=False,
    ),
    # `benchmarks.gpu_check`'s second model: a transformers Llama of ~1.1 B parameters (TinyLlama's width, 16
    # layers, GQA 16/8, MLP 4 x dim), FSDP only, package against the hand loop; and the same at smoke size.
    "gpu-llama": Preset(
        Size(dim=2048, hidden=8192, depth=16, seq=2048, batch=4, kind="llama", heads=16, kv_heads=8, vocab=32000),
        "bf16-mixed",
        (1,),
        families=("fsdp",),
        drivers=("plain", "dpar"),
        checkpoints=False,
        warmup=3,
        steps=8,
    ),
    "gpu-llama-smoke": Preset(
        Size(dim=64, hidden=128, depth=2, seq=32, batch=2, kind="llama", heads=4, kv_heads=2, vocab=128),
        "bf16-mixed",
        (1,),
        families=("fsdp",),
        drivers=("plain", "dpar"),
        checkpoints=False,
    ),
}
DEFAULT_PRESET = {"cpu": "cpu", "cuda": "gpu"}


def tp_plan(size: Size) -> dict[str, str]:
    """The tensor-parallel plan relative to the LightningModule (its `model` attribute holds the network)."""
    if size.kind == "gpt":
        from lightning_dpar.examples.gpt import TP_PLAN as GPT_TP_PLAN

        return dict(GPT_TP_PLAN)
    return {"model.layers.*.fc1": "colwise", "model.layers.*.fc2": "rowwise"}


def block_tp_plan(size: Size) -> dict[str, ParallelStyle]:
    """The same plan as `parallelize_module` styles relative to one block, for the hand-parallelised runs."""
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    prefix = "model.blocks.*." if size.kind == "gpt" else "model.layers.*."
    plan = {}
    for pattern, style in tp_plan(size).items():
        relative = pattern[len(prefix) :]
        if relative == "attn.[qkv]":
            plan.update({f"attn.{name}": styles[style]() for name in "qkv"})
        else:
            plan[relative] = styles[style]()
    return plan


def block_class(size: Size) -> type[nn.Module]:
    if size.kind == "llama":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        return LlamaDecoderLayer
    return GPTBlock if size.kind == "gpt" else Block


def blocks(net: nn.Module) -> nn.ModuleList:
    """The repeated blocks: FSDP units, compile units and tensor-parallel targets."""
    if isinstance(net, Decoder):
        return net.blocks
    return net.model.layers if hasattr(net, "model") else net.layers  # `LlamaForCausalLM.model.layers`


def parameter_count(size: Size) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in _new_net(size).parameters())


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(size.dim, size.hidden) for _ in range(size.depth))
        self.out = nn.Linear(size.dim, size.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def _new_llama(size: Size) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=size.vocab,
        hidden_size=size.dim,
        intermediate_size=size.hidden,
        num_hidden_layers=size.depth,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=size.seq,
        use_cache=False,  # training: no key/value cache (as the hand loop to beat is written)
    )
    return LlamaForCausalLM(config)


def _new_net(size: Size) -> nn.Module:
    if size.kind == "llama":
        return _new_llama(size)
    if size.kind == "gpt":
        return Decoder(size.vocab, size.seq, size.depth, size.heads, size.dim)
    return Net(size)


def build_net(size: Size, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    net = _new_net(size)
    if isinstance(net, Decoder):
        net.init_weights()
    return net


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


class SyntheticTokens(Dataset):
    """`n` samples: for the MLP, random `[seq, dim]` inputs and targets (embeddings already applied); for the GPT and
    the Llama, random token ids `[seq + 1]` (inputs and next-token targets). Only `pool` distinct samples are stored and
    repeated, so GPU-sized runs do not hold gigabytes of data in every process."""

    def __init__(self, size: Size, n: int, pool: int = 32, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.n = n
        rows = min(n, pool)
        if size.kind in ("gpt", "llama"):
            tokens = torch.randint(0, size.vocab, (rows, size.seq + 1), generator=g)
            self.x, self.y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        else:
            self.x = torch.randn(rows, size.seq, size.dim, generator=g)
            self.y = torch.randn(rows, size.seq, size.dim, generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i % len(self.x)], self.y[i % len(self.x)]


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    out = model(x)
    out = getattr(out, "logits", out)  # transformers: a `CausalLMOutput`
    if y.dtype == torch.int64:  # token ids: next-token cross-entropy, in fp32 as under mixed precision
        return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))
    return F.mse_loss(out, y)


class BenchModule(L.LightningModule):
    """The LightningModule every Lightning-driven variant trains (the same `Net`, loss and optimizer)."""

    def __init__(self, size: Size) -> None:
        super().__init__()
        self.size = size
        self.model = build_net(size)

    def training_step(self, batch, batch_idx):
        return loss_fn(self.model, batch)

    def configure_optimizers(self):
        return make_optimizer(self.parameters())


class HandParallelModule(BenchModule):
    """For Lightning's `ModelParallelStrategy`: the same TP plan and FSDP units, written by hand in
    `configure_model` as that strategy's docs show."""

    def configure_model(self):
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        if isinstance(self.model, FSDPModule):
            return
        tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        for layer in blocks(self.model):
            if tp_mesh.size() > 1:
                parallelize_module(layer, tp_mesh, block_tp_plan(self.size))
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(self.model, mesh=dp_mesh)
