"""`consolidate` (`lightning_dpar/checkpoint/consolidate.py`) on checkpoints a real Trainer wrote in this process
(one-rank gloo group): the Lightning `.ckpt` holds the trained weights and optimizer state, safetensors files hold the
weights within the size limit, and `--format hf` is what `from_pretrained` loads. Consolidating 4-rank checkpoints is in
`tests/launched/test_checkpoint_reshard.py`; unusable input in `tests/launched/test_checkpoint_safety.py`."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_dpar import FSDPTensorParallelStrategy, FullyShardStrategy
from lightning_dpar.checkpoint.consolidate import main as consolidate
from lightning_dpar.checkpoint.consolidate import parse_size
from tests.conftest import ROOT, subprocess_env
from tests.support import malicious
from tests.support.checkpoint_files import copy_of, write_full, write_sharded
from tests.support.hf_configs import decoder_config
from tests.support.models import TP_PLAN, ParityModule, RegressionData, loader
from tests.workers.common import BATCH, full_params, trainer_for


@pytest.fixture
def trained(gloo_world, tmp_path):
    """A 2D (TP 1 x FSDP 1) Adam run's sharded checkpoint and its full parameters."""
    trainer = trainer_for(FSDPTensorParallelStrategy(tensor_parallel_size=1, tp_plan=TP_PLAN), devices=1, max_steps=2)
    trainer.fit(ParityModule(optimizer="adam"), loader(RegressionData(n=16), BATCH))
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    return tmp_path / "run.ckpt", full_params(trainer)


def _read_safetensors(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def test_lightning_ckpt_holds_the_trained_weights_and_resumes_on_one_device(trained, tmp_path, capsys):
    sharded, weights = trained
    assert consolidate([str(sharded), str(tmp_path / "one.ckpt")]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'one.ckpt'}\n"
    checkpoint = torch.load(tmp_path / "one.ckpt", weights_only=False)
    assert set(checkpoint["state_dict"]) == set(weights)
    for name, tensor in weights.items():
        assert torch.equal(checkpoint["state_dict"][name], tensor), name
    (adam,) = checkpoint["optimizer_states"]
    assert sorted(adam["state"]) == list(range(len(weights)))  # keyed by position, like a plain optimizer's
    assert checkpoint["global_step"] == 2
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False)
    trainer.fit(ParityModule(optimizer="adam"), loader(RegressionData(n=16), BATCH), ckpt_path=tmp_path / "one.ckpt")
    assert trainer.global_step == 3


def test_safetensors_files_stay_under_the_size_limit_with_an_index(trained, tmp_path):
    sharded, weights = trained
    out = tmp_path / "weights"
    assert consolidate([str(sharded), str(out), "--format", "safetensors", "--max-shard-size", "400B"]) == 0
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert all(p.stat().st_size <= 400 + 1024 for p in out.glob("*.safetensors"))  # the limit, plus its header
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(weights) and set(index["weight_map"].values()) == set(files)
    got = _read_safetensors(out)
    assert all(torch.equal(got[name], tensor) for name, tensor in weights.items())


def test_safetensors_strip_prefix_gives_one_file_under_the_limit(trained, tmp_path):
    sharded, weights = trained
    out = tmp_path / "stripped"
    assert consolidate([str(sharded), str(out), "--format", "safetensors", "--strip-prefix", "model."]) == 0
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]
    got = _read_safetensors(out)
    assert set(got) == {name.removeprefix("model.") for name in weights}
    assert torch.equal(got["inp.weight"], weights["model.inp.weight"])


def test_strip_prefix_is_for_safetensors_only(trained, tmp_path, capsys):
    with pytest.raises(SystemExit):
        consolidate([str(trained[0]), str(tmp_path / "x"), "--strip-prefix", "model."])
    assert "--strip-prefix applies to --format safetensors only" in capsys.readouterr().err


def test_hf_format_needs_a_transformers_model(trained, tmp_path, capsys):
    assert consolidate([str(trained[0]), str(tmp_path / "hf"), "--format", "hf"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("consolidate: ") and err.count("\n") == 1 and "run.ckpt" in err


class _Llama(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        config = decoder_config(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=8,
        )
        self.net = LlamaForCausalLM(config)

    def training_step(self, batch, batch_idx):
        return self.net(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def test_hf_format_is_what_from_pretrained_loads(gloo_world, tmp_path, capsys):
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM

    trainer = trainer_for(FullyShardStrategy(), devices=1, max_steps=2)
    ids = torch.randint(0, 32, (8, 8), generator=torch.Generator().manual_seed(0))
    trainer.fit(_Llama(), DataLoader(ids, batch_size=4))
    weights = full_params(trainer)
    trainer.save_checkpoint(tmp_path / "llama.ckpt")
    assert consolidate([str(tmp_path / "llama.ckpt"), str(tmp_path / "hf"), "--format", "hf"]) == 0
    written = capsys.readouterr().out
    assert "config.json" in written and "model.safetensors" in written
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, weights[f"net.{name}"]), name


@pytest.mark.parametrize(("text", "size"), [("5GB", 5 * 10**9), ("2 GiB", 2 * 2**30), ("1.5MB", 1_500_000), ("7", 7)])
def test_sizes_in_decimal_and_binary_units(text, size):
    assert parse_size(text) == size


def test_an_unknown_size_unit_says_what_is_valid():
    with pytest.raises(argparse.ArgumentTypeError, match=r"invalid size '5XB'.*5GB, 500MB, 2GiB"):
        parse_size("5XB")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return write_sharded(tmp_path_factory.mktemp("pristine") / "good.ckpt")


# ---------------------------------------------------------------------- consolidate on bad input
def bad_inputs(pristine: Path, tmp_path: Path) -> dict[str, tuple[Path, str]]:
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    empty = tmp_path / "empty"
    empty.mkdir()
    partial = copy_of(pristine, tmp_path, "partial.ckpt")
    (partial / "meta.pt").unlink()
    hidden = copy_of(pristine, tmp_path, ".dpar-partial-0123456789-abcd")
    corrupt = copy_of(pristine, tmp_path, "corrupt_index.ckpt")
    (corrupt / ".metadata").write_bytes((corrupt / ".metadata").read_bytes()[:50])
    hostile = copy_of(pristine, tmp_path, "hostile.ckpt")
    (hostile / ".metadata").write_bytes(malicious.index_payloads(tmp_path / "PAYLOAD_RAN", tmp_path)["builtins_eval"])
    return {
        "nonexistent": (tmp_path / "nope.ckpt", "does not exist"),
        "text_file": (text, "is a file that is not a checkpoint, expected a sharded checkpoint directory"),
        "full_format_file": (write_full(tmp_path / "full.ckpt"), "is a single checkpoint file (the full format"),
        "empty_dir": (empty, "is a directory but not a sharded checkpoint: it lacks '.metadata', 'meta.pt'"),
        "partial_dir": (partial, "is a directory but not a sharded checkpoint: it lacks 'meta.pt'"),
        "hidden_partial_dir": (hidden, "is an incomplete checkpoint"),
        "corrupt_index": (corrupt / ".metadata", "cannot be read as a DCP index"),
        "hostile_index": (hostile / ".metadata", "refers to builtins.eval"),
    }


BAD_INPUTS = ["nonexistent", "text_file", "full_format_file", "empty_dir", "partial_dir", "hidden_partial_dir"]
BAD_INPUTS += ["corrupt_index", "hostile_index"]


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_consolidate_bad_input_is_one_line_naming_it(pristine, tmp_path, capsys, case):
    named, expected = bad_inputs(pristine, tmp_path)[case]
    source = named.parent if named.name == ".metadata" else named
    assert consolidate([str(source), str(tmp_path / "out.ckpt")]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("consolidate: "), err
    assert repr(str(named)) in err and expected in err, err
    assert not (tmp_path / "out.ckpt").exists() and not (tmp_path / "PAYLOAD_RAN").exists()


def test_consolidate_unwritable_output_is_one_line(pristine, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert consolidate([str(pristine), str(blocker / "out.ckpt")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(blocker) in err and "Error" in err


@pytest.mark.slow
def test_consolidate_command_line_prints_no_traceback(pristine, tmp_path):
    """The real command, in its own process, on a hostile index: one line, exit 1, nothing run."""
    named, expected = bad_inputs(pristine, tmp_path)["hostile_index"]
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_dpar", "consolidate", str(named.parent), str(tmp_path / "out.ckpt")],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("consolidate: ") and repr(str(named)) in lines[0] and expected in lines[0]
    assert not (tmp_path / "PAYLOAD_RAN").exists()
