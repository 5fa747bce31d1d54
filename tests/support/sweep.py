"""The property-based sweep's draws (issue 32): a model of drawn layer shapes, a tensor-parallel plan of drawn
styles, an optimizer, gradient accumulation and clipping; the module that trains a draw through a real Trainer and
the single-process reference it must equal. Shared by the in-process sweep (`tests/unit/test_sweep.py`, drawn by
hypothesis) and the multi-rank fixed set (`tests/workers/sweep.py`, drawn once from a seed by `seeded_draws`)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, DistributedSampler

#: Layer sizes are drawn from 1..MAX_DIM: non-square, odd, and 1 (a single row or column).
MAX_DIM = 17
MAX_DEPTH = 3
OPTIMIZERS = ("sgd_momentum", "adamw", "muon", "lars")
CLIPS = (None, "norm", "value")
#: Tensor-parallel styles of one block (`fc1` then `fc2`): both split (column- then row-wise, the hidden size split
#: between them), only `fc1` split with its output gathered, only `fc2` split on an input it scatters, or neither.
BLOCK_STYLES = ("pair", "colwise_rep", "rowwise_rep", "none")
#: Samples of the data: enough for 3 steps x 3 accumulated batches x 4 samples on each of 4 data-parallel ranks, so
#: no draw crosses an epoch (whose reshuffle the reference does not replay).
SAMPLES = 160


@dataclass(frozen=True)
class Draw:
    """One drawn run. `hidden` has one size per block (its length is the depth)."""

    in_dim: int
    dim: int
    hidden: tuple[int, ...]
    out_dim: int
    bias: bool
    optimizer: str
    accumulate: int = 1
    clip: str | None = None
    steps: int = 3
    block_styles: tuple[str, ...] = ()  # one per block, where the layout applies a tensor-parallel plan
    split_inp: bool = False  # `inp` column-wise with its output gathered (splits `dim`)
    split_out: bool = False  # `out` column-wise with its output gathered (splits `out_dim`)
    seed: int = 0

    @property
    def depth(self) -> int:
        return len(self.hidden)

    @property
    def name(self) -> str:
        """A short, unique, readable id without commas (case names are listed comma-separated by the relaunches):
        `5-7x[3.8]-2_b_lars_acc2_norm_s3_r42_tp[pair+none]io` (steps, seed)."""
        shape = f"{self.in_dim}-{self.dim}x[{'.'.join(map(str, self.hidden))}]-{self.out_dim}"
        parts = [shape, "b" if self.bias else "nb", self.optimizer, f"acc{self.accumulate}", self.clip or "noclip"]
        parts += [f"s{self.steps}", f"r{self.seed}"]
        if self.block_styles:
            ends = ("i" if self.split_inp else "") + ("o" if self.split_out else "")
            parts.append(f"tp[{'+'.join(self.block_styles)}]{ends}")
        return "_".join(parts)

    def tp_plan(self) -> dict[str, str]:
        plan: dict[str, str] = {}
        for i, style in enumerate(self.block_styles):
            if style in ("pair", "colwise_rep"):
                plan[f"model.layers.{i}.fc1"] = "colwise" if style == "pair" else "colwise_rep"
            if style in ("pair", "rowwise_rep"):
                plan[f"model.layers.{i}.fc2"] = "rowwise" if style == "pair" else "rowwise_rep"
        if self.split_inp:
            plan["model.inp"] = "colwise_rep"
        if self.split_out:
            plan["model.out"] = "colwise_rep"
        return plan

    def tp_splits(self) -> list[tuple[str, str, int]]:
        """(module, weight attribute, size) of every dimension the plan splits over the tensor-parallel ranks."""
        splits = []
        for i, style in enumerate(self.block_styles):
            if style in ("pair", "colwise_rep"):
                splits.append((f"model.layers.{i}.fc1", "out_features", self.hidden[i]))
            if style in ("pair", "rowwise_rep"):
                splits.append((f"model.layers.{i}.fc2", "in_features", self.hidden[i]))
        if self.split_inp:
            splits.append(("model.inp", "out_features", self.dim))
        if self.split_out:
            splits.append(("model.out", "out_features", self.out_dim))
        return splits

    def clip_kwargs(self) -> dict:
        if self.clip is None:
            return {}
        return {"gradient_clip_val": CLIP_VALUES[self.clip], "gradient_clip_algorithm": self.clip}


CLIP_VALUES = {"norm": 0.05, "value": 0.01}


class SweepBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.relu(self.fc1(x)))


class SweepNet(nn.Module):
    """`inp -> layers[*] -> out` of the drawn sizes (the test models' `Net`, every size drawn)."""

    def __init__(self, draw: Draw) -> None:
        super().__init__()
        self.inp = nn.Linear(draw.in_dim, draw.dim, bias=draw.bias)
        self.layers = nn.ModuleList(SweepBlock(draw.dim, h, draw.bias) for h in draw.hidden)
        self.out = nn.Linear(draw.dim, draw.out_dim, bias=draw.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.inp(x))
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


class SweepData(Dataset):
    def __init__(self, draw: Draw, n: int = SAMPLES) -> None:
        g = torch.Generator().manual_seed(1234 + draw.seed)
        self.x = torch.randn(n, draw.in_dim, generator=g)
        self.y = torch.randn(n, draw.out_dim, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class NormScaledSGD(torch.optim.Optimizer):
    """A user's LARS-like optimizer written with plain tensor ops, unknown to the package: each tensor's step is its
    gradient scaled by `||w|| / ||g||` (not elementwise; exact on DTensors, whose norms are global)."""

    def __init__(self, params, lr: float = 0.02) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                ratio = p.norm() / (p.grad.norm() + 1e-12)  # a dead ReLU's layer has a zero gradient
                p.add_(p.grad * ratio, alpha=-group["lr"])
        return loss


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    if name == "muon":
        return torch.optim.Muon(params, lr=0.02)  # 2-D parameters only: Muon draws have no biases
    if name == "lars":
        return NormScaledSGD(params)
    raise ValueError(name)


class SweepModule(L.LightningModule):
    def __init__(self, draw: Draw) -> None:
        super().__init__()
        self.draw = draw
        torch.manual_seed(draw.seed)
        self.model = SweepNet(draw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return make_optimizer(self.draw.optimizer, self.parameters())


def initial_params(draw: Draw) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in SweepModule(draw).state_dict().items()}


def global_micro_batches(data: Dataset, dp: int, batch_size: int, steps: int, accumulate: int):
    """What Lightning's sampler feeds `dp` ranks (`tests.support.models.global_batches`), as one list per optimizer
    step of its `accumulate` micro-batches, each the `dp` ranks' micro-batches of that micro-step together."""
    per_rank = [list(DistributedSampler(data, num_replicas=dp, rank=r, shuffle=True, seed=0)) for r in range(dp)]
    steps_batches = []
    for step in range(steps):
        micro = []
        for j in range(accumulate):
            start = (step * accumulate + j) * batch_size
            idx = [i for r in range(dp) for i in per_rank[r][start : start + batch_size]]
            micro.append((data.x[idx], data.y[idx]))
        steps_batches.append(micro)
    return steps_batches


def reference_train(draw: Draw, data: Dataset, dp: int, batch_size: int) -> dict[str, torch.Tensor]:
    """One process on the same global batches, accumulating their micro-batches as Lightning does (each loss divided
    by the number accumulated, one backward each). Accumulating the same samples as one concatenated batch sums the
    gradient in another order, and Muon's bfloat16 Newton-Schulz can magnify that last-bit difference: 2.0e-4 for
    Lightning's own single-device Trainer on a drawn Muon run (`test_sweep.py::test_muon_with_accumulation_...`)."""
    module = SweepModule(draw)
    model, opt = module.model, module.configure_optimizers()
    for micro_batches in global_micro_batches(data, dp, batch_size, draw.steps, draw.accumulate):
        opt.zero_grad()
        for x, y in micro_batches:
            (F.mse_loss(model(x), y) / draw.accumulate).backward()
        if draw.clip == "norm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_VALUES["norm"])
        elif draw.clip == "value":
            torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VALUES["value"])
        opt.step()
    return {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}


def differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> dict:
    """The largest difference to the reference, the parameter where it is, and how far the reference moved."""
    assert set(got) == set(want), (sorted(got), sorted(want))
    diffs = {k: (got[k].float() - want[k].float()).abs().max().item() for k in want}
    worst = max(diffs, key=diffs.get)
    return {
        "max_abs_diff": diffs[worst],
        "worst": worst,
        "moved": max((want[k] - start[k]).abs().max().item() for k in want),
    }


# ------------------------------------------------------------------------------------------- the multi-rank set
#: Layouts of the fixed multi-rank set, per world size (`tests/workers/sweep.py::strategy_and_dp` builds them):
#: `tp` is TP 2 alone, `replicate_tp` DDP over TP 2, `tp_fsdp` TP 2 x FSDP 2, `pp` PP 2 alone, `pp_fsdp` PP 2 x FSDP 2,
#: `pp_tp` PP 2 x TP 2.
MULTI_RANK_LAYOUTS = {
    2: ("fsdp", "replicate", "tp", "replicate_tp", "pp"),
    4: ("fsdp", "hsdp", "tp_fsdp", "replicate", "pp_fsdp", "pp_tp"),
}
TP_LAYOUTS = ("tp", "replicate_tp", "tp_fsdp", "pp_tp")


def muon_exact_bitwise(world: int, layout: str) -> bool:
    """Where the layout sums gradients as Lightning's DDP does, bit for bit (FSDP and DDP on 2 ranks: a sum of two
    per-rank terms): Muon's bfloat16 Newton-Schulz amplifies any last-bit difference of the gradient
    (docs/optimizers.md), so the fixed set draws Muon only there, and compares it with Lightning's DDP
    (`tests/workers/sweep.py::run_draw` says why not with one process)."""
    return world == 2 and layout in ("fsdp", "replicate")


def seeded_draws(world: int, per_layout: int, seed: int = 1234) -> list[tuple[str, Draw]]:
    """The fixed multi-rank draws of `world` ranks: `per_layout` per layout, from `random.Random(seed + world)`.

    Under tensor parallelism the split sizes are made divisible by 2 three times in four, so most TP draws train and
    the others must be refused by name. AdamW is drawn on every layout (its first steps divide each gradient entry by
    its own magnitude, which can amplify a summation-order difference; see `tests/launched/test_sweep.py`)."""
    rng = random.Random(seed + world)
    draws = []
    for layout in MULTI_RANK_LAYOUTS[world]:
        for i in range(per_layout):
            optimizers = ["sgd_momentum", "adamw", "lars"] + (["muon"] if muon_exact_bitwise(world, layout) else [])
            optimizer = optimizers[(i + rng.randrange(len(optimizers))) % len(optimizers)]
            pipelined = layout.startswith("pp")
            depth = rng.randint(2 if pipelined else 1, MAX_DEPTH)  # two stages need two blocks
            even = layout in TP_LAYOUTS and rng.random() < 0.75

            def size(even=even):
                n = rng.randint(1, MAX_DIM)
                return max(2, n - n % 2) if even else n

            styles = tuple(rng.choice(BLOCK_STYLES) for _ in range(depth)) if layout in TP_LAYOUTS else ()
            if styles and set(styles) == {"none"}:
                styles = ("pair", *styles[1:])  # every TP draw splits something (its ends are drawn below)
            draw = Draw(
                in_dim=rng.randint(1, MAX_DIM),
                dim=size(),
                hidden=tuple(size() for _ in range(depth)),
                out_dim=size(),
                bias=optimizer != "muon" and rng.random() < 0.5,
                optimizer=optimizer,
                accumulate=rng.randint(1, 3),
                clip=rng.choice(CLIPS),
                steps=rng.randint(2, 3),
                block_styles=styles,
                split_inp=layout in TP_LAYOUTS and rng.random() < 0.3,
                split_out=layout in TP_LAYOUTS and rng.random() < 0.3,
                seed=rng.randrange(1000),
            )
            draws.append((layout, draw))
    return draws


#: Draws a hunt (a larger `per_layout` or another seed) found, kept in the fixed set whatever the seed draws.
KEPT_DRAWS: dict[int, list[tuple[str, Draw]]] = {
    # Muon with 2 accumulated batches: 3.1e-4 from one process under FSDP, and under this package's DDP, Lightning's
    # DDP and a hand-written DDP loop alike (0.0 between them): the order of summing ranks and micro-batches, which
    # Muon magnifies. Why Muon draws are compared with Lightning's DDP (`tests/workers/sweep.py::run_draw`).
    2: [("fsdp", Draw(8, 9, (16, 7), 11, bias=False, optimizer="muon", accumulate=2, clip=None, steps=2, seed=295))],
    4: [],
}


def multi_rank_draws(world: int, per_layout: int, seed: int) -> list[tuple[str, Draw]]:
    """The multi-rank set of `world` ranks: the seeded draws and the kept ones."""
    return seeded_draws(world, per_layout, seed) + KEPT_DRAWS[world]
