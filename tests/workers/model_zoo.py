"""The model-zoo conformance matrix: every decoder family whose transformers tensor-parallel plan the package claims,
as a tiny config with the family's own `tie_word_embeddings`, under every layout, through real Trainers on 4 gloo
ranks. A cell (family x layout) is one case that runs all four checks:

- pretrained in: the strategy's `pretrained=` loads a `save_pretrained` directory into a model built with other
  random weights; the parameters right after setup are exactly `from_pretrained`'s;
- parity: 4 steps match single-process training from `from_pretrained` on the same global batches (fp32);
- resume: `fit(ckpt_path=<the step-2 checkpoint>)` ends at exactly the uninterrupted run's parameters;
- export out: `consolidate --format hf` of the step-4 checkpoint loads with `from_pretrained` with no missing and no
  unexpected key, and exactly the trained weights.

Every check also needs the parallelised model to share the parameters the model shares (tied embeddings stay
tied). Or the cell is refused: the first `fit` raises on every rank before the first training batch, and the
message is the result. A refusal of the pretrained directory itself (`PretrainedLoadError`) is a failure, not a
refusal: the directory is the model's own `save_pretrained`, so it fits any faithful parallelisation.

`classify` turns a case's result into the verdict; `benchmarks/zoo.py` (the documented matrix) and
`tests/launched/test_model_zoo.py` (the part CI runs) both read it. The pretrained directories are written by the
launching side (`save_pretrained_dirs`) next to the results directory.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy, ReplicateStrategy
from lightning_dpar.__main__ import main as dpar_main
from lightning_dpar.hf_weights.pretrained import checkpoint_shapes, tied_groups
from tests.support.hf_configs import decoder_settings
from tests.workers.cases import Case
from tests.workers.common import full_params, trainer_for
from tests.workers.hf_models import TokenIds

VOCAB, SEQ, BATCH, STEPS, RESUME_FROM = 64, 8, 2, 4, 2
LR = 0.1
#: Parity with single-process training in fp32; loading and exporting must be exact.
ATOL = 1e-5
#: A resumed fit against the uninterrupted one: exact under the sharded layouts. Under `dpar_replicate` the all-reduce
#: sums in another order in the first step after the restart (DDP reorders its gradient buckets after the first step
#: of every fit), which moves the last bit of some values; a lost optimizer state would differ by ~LR x gradient.
RESUME_ATOL = 1e-6
#: The cells a launch runs (comma-separated `cell_name`s; unset: every cell of the groups launched).
CELLS_ENV = "DPAR_ZOO_CELLS"

#: What every tiny config shares: 2 decoder layers (one per pipeline stage), GQA where the family has it.
_COMMON = decoder_settings(vocab_size=VOCAB, max_position_embeddings=32)


@dataclass(frozen=True)
class Family:
    """A decoder family: its config and causal-LM classes in `transformers`, and the tiny config's settings (the
    family's own `tie_word_embeddings` unless `tie` says otherwise)."""

    config_class: str
    model_class: str
    settings: dict[str, Any]
    tie: bool | None = None

    def config(self):
        import transformers

        settings = dict(self.settings)
        if self.tie is not None:
            settings["tie_word_embeddings"] = self.tie
        return getattr(transformers, self.config_class)(**settings)

    def build(self):
        import transformers

        return getattr(transformers, self.model_class)(self.config())


_NO_SPECIAL_TOKENS = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)  # defaults beyond the tiny vocab

FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaConfig", "LlamaForCausalLM", _COMMON),
    "llama-tied": Family("LlamaConfig", "LlamaForCausalLM", _COMMON, tie=True),
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM", _COMMON),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", {**_COMMON, "head_dim": 8}),
    "mistral": Family("MistralConfig", "MistralForCausalLM", _COMMON),
    "gemma": Family("GemmaConfig", "GemmaForCausalLM", {**_COMMON, "head_dim": 8}),
    "gemma2": Family("Gemma2Config", "Gemma2ForCausalLM", {**_COMMON, "head_dim": 8}),
    "gemma3": Family("Gemma3TextConfig", "Gemma3ForCausalLM", {**_COMMON, "head_dim": 8}),
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", {**_COMMON, **_NO_SPECIAL_TOKENS}),
    "gpt-neox": Family(
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        {k: v for k, v in _COMMON.items() if k != "num_key_value_heads"} | _NO_SPECIAL_TOKENS,
    ),
    "olmo2": Family("Olmo2Config", "Olmo2ForCausalLM", {**_COMMON, **_NO_SPECIAL_TOKENS}),
}


@dataclass(frozen=True)
class Layout:
    """A strategy on 4 ranks, built with the pretrained directory, and its data-parallel size."""

    description: str
    make: Callable[[str], Any]
    data_parallel: int


def _layouts() -> dict[str, Layout]:
    return {
        "dpar_fsdp": Layout("FSDP 4", lambda path: FullyShardStrategy(pretrained=path), 4),
        "dpar_2d": Layout(
            'TP 2 x FSDP 2, `tp_plan="auto"`',
            lambda path: FSDPTensorParallelStrategy(tensor_parallel_size=2, tp_plan="auto", pretrained=path),
            2,
        ),
        "dpar_3d": Layout(
            'PP 2 x TP 2 (1F1B, 2 microbatches), `tp_plan="auto"`',
            lambda path: FSDPTensorParallelStrategy(
                pipeline_parallel_size=2, tensor_parallel_size=2, tp_plan="auto", pretrained=path
            ),
            1,
        ),
        "dpar_replicate": Layout("DDP 4", lambda path: ReplicateStrategy(pretrained=path), 4),
    }


LAYOUTS = ("dpar_fsdp", "dpar_2d", "dpar_3d", "dpar_replicate")


def layout_descriptions() -> dict[str, str]:
    return {name: layout.description for name, layout in _layouts().items()}


WORLD_SIZE = 4


def cell_name(family: str, layout: str) -> str:
    return f"zoo-{family}-{layout}"


def launch_args(cells: list[tuple[str, str]]) -> tuple[str, dict[str, str]]:
    """The worker groups and environment of one launch that runs `cells` (`(family, layout)` pairs)."""
    groups = ",".join(f"zoo_{layout}" for layout in LAYOUTS if any(cell[1] == layout for cell in cells))
    return groups, {CELLS_ENV: ",".join(cell_name(*cell) for cell in cells)}


def pretrained_dir(workdir: Path, family: str) -> Path:
    return workdir / "zoo_pretrained" / family


def save_pretrained_dirs(workdir: Path, families: list[str]) -> None:
    """The "downloaded" models: each family's tiny model, seed 0, written with `save_pretrained` (several shards)."""
    for family in families:
        torch.manual_seed(0)
        FAMILIES[family].build().save_pretrained(pretrained_dir(workdir, family), max_shard_size="20KB")


# ------------------------------------------------------------------------------------------ inside the launch
def _workdir() -> Path:
    return Path(sys.argv[2]).resolve().parent  # the launch's results directory sits in the work directory


class CausalLM(L.LightningModule):
    """The family's model as `self.model`, built from the config with other random weights than the pretrained
    ones (seed 123): only a load that reaches every parameter makes the values match."""

    def __init__(self, family: str) -> None:
        super().__init__()
        torch.manual_seed(123)
        self.model = FAMILIES[family].build()

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        # SGD with momentum: the parameters move by lr x (accumulated) gradient, so parity measures the gradients,
        # and the momentum buffers are optimizer state that a resume must restore.
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


class Watch(Callback):
    """Right after setup: the full parameters (the pretrained load; a collective) and the names that share a
    parameter on this rank; and whether a training batch ran."""

    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}
        self.shared: list[list[str]] = []
        self.trained_a_batch = False

    def on_train_start(self, trainer, pl_module) -> None:
        self.loaded = {k: v.clone() for k, v in full_params(trainer).items()}
        self.shared = sorted(tied_groups(pl_module))

    def on_train_batch_start(self, *args) -> None:
        self.trained_a_batch = True


def _reference(path: Path, data: TokenIds, dp: int) -> dict[str, torch.Tensor]:
    """Single-process training from `from_pretrained` on the global batches Lightning's sampler feeds `dp` ranks."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    per_rank = [list(DistributedSampler(data, num_replicas=dp, rank=r, shuffle=True, seed=0)) for r in range(dp)]
    for step in range(STEPS):
        batch = data.ids[[i for r in range(dp) for i in per_rank[r][step * BATCH : (step + 1) * BATCH]]]
        optimizer.zero_grad()
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], prefix: str) -> dict[str, Any]:
    """The largest absolute difference over `want`'s keys (looked up as `prefix + key` in `got`), and the keys of
    `want` that `got` lacks."""
    missing = sorted(k for k in want if prefix + k not in got)
    diffs = [(got[prefix + k].float() - v.float()).abs().max().item() for k, v in want.items() if prefix + k in got]
    return {"max_abs_diff": max(diffs, default=float("inf")), "missing": missing}


def _export(ckpt: Path, out: Path, trained: dict[str, torch.Tensor], pretrained: Path) -> dict[str, Any]:
    """`python -m lightning_dpar consolidate CKPT OUT --format hf` (its `main`, in this process), then
    `from_pretrained(OUT)` against the trained parameters, and OUT's tensor names against `save_pretrained`'s."""
    from transformers import AutoModelForCausalLM

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = dpar_main(["consolidate", str(ckpt), str(out), "--format", "hf"])
    if code != 0:
        return {"code": code, "error": stderr.getvalue().strip()}
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    names, saved = set(checkpoint_shapes(out)), set(checkpoint_shapes(pretrained))
    return {
        "code": code,
        "names_not_saved": sorted(names - saved),  # tensor names save_pretrained would not have written
        "names_not_exported": sorted(saved - names),
        "missing": sorted(info["missing_keys"]),
        "unexpected": sorted(info["unexpected_keys"]),
        **_compare(trained, model.state_dict(), "model."),
    }


def cell_case(family: str, layout_name: str) -> dict[str, Any] | None:
    """One cell: the first fit (pretrained in, 4 steps, checkpoints at steps 2 and 4), the resumed fit from step 2,
    then on rank 0 the comparisons and the export. Returns `{"refused": message}` if the first fit raised before its
    first training batch."""
    layout = _layouts()[layout_name]
    path = pretrained_dir(_workdir(), family)
    ckpt_dir = _workdir() / "zoo_checkpoints" / f"{family}-{layout_name}"
    data = TokenIds(n=32, seed=7)

    def fit(ckpt_path: str | None, callbacks: list) -> L.Trainer:
        saves = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=RESUME_FROM, save_top_k=-1, save_last=False)
        trainer = trainer_for(
            layout.make(str(path)), max_steps=STEPS, callbacks=[*callbacks, saves], enable_checkpointing=True
        )
        trainer.fit(CausalLM(family), DataLoader(data, batch_size=BATCH), ckpt_path=ckpt_path)
        return trainer

    watch = Watch()
    try:
        first = fit(None, [watch])
    except Exception as error:
        if watch.trained_a_batch:
            raise
        return {"refused": f"{type(error).__name__}: {error}", "refused_by": type(error).__name__}
    trained = full_params(first)
    resumed = full_params(fit(str(ckpt_dir / f"epoch=0-step={RESUME_FROM}.ckpt"), []))
    if first.global_rank != 0:
        return None
    from transformers import AutoModelForCausalLM

    pretrained = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    torch.manual_seed(123)
    random_init = CausalLM(family)
    return {
        "refused": None,
        "tied": bool(FAMILIES[family].config().tie_word_embeddings),
        "shared": watch.shared,  # on rank 0, which holds the first pipeline stage
        "shared_before": sorted(tied_groups(random_init)),
        "random_init_diff": _compare(random_init.state_dict(), pretrained, "model.")["max_abs_diff"],
        "loaded": _compare(watch.loaded, pretrained, "model."),
        "trained": _compare(trained, _reference(path, data, layout.data_parallel), "model."),
        "resumed": _compare(resumed, {k[len("model.") :]: v for k, v in trained.items()}, "model."),
        "export": _export(ckpt_dir / f"epoch=0-step={STEPS}.ckpt", ckpt_dir / "hf", trained, path),
    }


def group_zoo(layout: str) -> Callable[[], Iterator[Case]]:
    """The cells of `layout` named in `CELLS_ENV` (all of them if it is unset)."""

    def cases() -> Iterator[Case]:
        selected = {name for name in os.environ.get(CELLS_ENV, "").split(",") if name}
        for family in FAMILIES:
            name = cell_name(family, layout)
            if not selected or name in selected:
                yield Case(name, lambda family=family: cell_case(family, layout), timeout_s=240)

    return cases


GROUPS = {f"zoo_{layout}": group_zoo(layout) for layout in LAYOUTS}


# ------------------------------------------------------------------------------------------ verdicts
def classify(result: dict[str, Any] | None, errors: dict[int, str] | None = None) -> tuple[str, str]:
    """`("pass" | "refused" | "FAILS", detail)` for a cell's result (or the tracebacks of the ranks where it
    raised after training began, or stopped the launch)."""
    if errors:
        last = next(iter(errors.values())).strip().splitlines()[-1]
        return "FAILS", f"crashed on ranks {sorted(errors)}: {last}"
    assert result is not None
    if result["refused"] is not None:
        if result["refused_by"] == "PretrainedLoadError":
            return "FAILS", f"the model's own save_pretrained directory is refused: {result['refused']}"
        return "refused", result["refused"]
    failures = []
    if result["shared"] != result["shared_before"]:
        failures.append(
            f"names sharing a parameter: {result['shared_before']} in the model, {result['shared']} in training"
        )
    if not result["random_init_diff"] > 0.01:
        failures.append("the model's own init equals the pretrained weights: the load check would prove nothing")
    for check, want in (("loaded", 0.0), ("trained", ATOL), ("resumed", RESUME_ATOL)):
        got = result[check]
        if got["missing"]:
            failures.append(f"{check}: keys missing {got['missing'][:3]}")
        elif not got["max_abs_diff"] <= want:
            failures.append(f"{check}: max |diff| {got['max_abs_diff']:.2e} (allowed {want:g})")
    export = result["export"]
    if export["code"] != 0:
        failures.append(f"export: consolidate exited {export['code']}: {export['error']}")
    else:
        if export["missing"] or export["unexpected"]:
            failures.append(f"export: missing {export['missing'][:3]}, unexpected {export['unexpected'][:3]}")
        if export["names_not_saved"] or export["names_not_exported"]:
            failures.append(
                f"export: tensor names {export['names_not_saved'][:3]} where save_pretrained writes"
                f" {export['names_not_exported'][:3]}"
            )
        if not export["max_abs_diff"] == 0.0:
            failures.append(f"export: from_pretrained differs from the trained weights by {export['max_abs_diff']:.2e}")
    return ("FAILS", "; ".join(failures)) if failures else ("pass", "")
