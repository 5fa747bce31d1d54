"""Fine-tuning a pretrained Hugging Face model, end to end, on 4 CPU processes (no network, no GPU):

1. write a tiny pretrained Llama (grouped-query attention) with `save_pretrained`, standing in for a downloaded one;
2. fine-tune it with `dpar_2d` (TP 2 x FSDP 2) from those weights: `python -m lightning_dpar fit --config
   llama_2d.yaml`, whose strategy argument `pretrained` loads each rank's shards;
3. export the sharded checkpoint: `python -m lightning_dpar consolidate checkpoints/finetune/last.ckpt finetuned
   --format hf` (config.json, generation_config.json and safetensors, the `model.` prefix stripped);
4. load the result with `AutoModelForCausalLM.from_pretrained` and compare it with the pretrained model.

Run: `python examples/finetune/run.py [--workdir DIR] [--max-steps N]` (files go to DIR, default the current one).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

HERE = Path(__file__).resolve().parent
PRETRAINED = "pretrained/tiny-llama"  # as in llama_2d.yaml
EXPORTED = "finetuned"


def write_pretrained(path: Path) -> None:
    """A small random Llama saved the way the Hugging Face Hub serves models: sharded safetensors plus an index."""
    if (path / "config.json").exists():
        return
    config = LlamaConfig(
        vocab_size=256,  # bytes
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, max_shard_size="100KB")
    print(f"wrote the pretrained model to {path}: {sorted(p.name for p in path.iterdir())}")


def run(command: list[str], extra_path: Path | None = None) -> None:
    env = dict(os.environ)
    if extra_path is not None:  # so the config's `llama_module.LlamaFineTune` imports
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), env.get("PYTHONPATH")]))
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, env=env)


def held_out_loss(model: torch.nn.Module, text: bytes) -> float:
    ids = torch.tensor([list(text)])
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=".", help="where the model, checkpoints and export are written")
    parser.add_argument("--max-steps", type=int, default=40)
    args = parser.parse_args(argv)
    os.chdir(args.workdir)
    write_pretrained(Path(PRETRAINED))
    python = sys.executable
    fit = [python, "-m", "lightning_dpar", "fit", "--config", str(HERE / "llama_2d.yaml")]
    run([*fit, f"--trainer.max_steps={args.max_steps}", "--trainer.enable_progress_bar=false"], extra_path=HERE)
    run([python, "-m", "lightning_dpar", "consolidate", "checkpoints/finetune/last.ckpt", EXPORTED, "--format", "hf"])

    finetuned, info = AutoModelForCausalLM.from_pretrained(EXPORTED, output_loading_info=True)
    pretrained = AutoModelForCausalLM.from_pretrained(PRETRAINED)
    print(
        f"from_pretrained({EXPORTED!r}): missing keys {sorted(info['missing_keys'])},"
        f" unexpected keys {sorted(info['unexpected_keys'])}"
    )
    sample = Path(os.__file__).read_bytes()[:2048]  # Python source, like the training data
    before, after = held_out_loss(pretrained, sample), held_out_loss(finetuned, sample)
    print(f"loss on {len(sample)} bytes of os.py: pretrained {before:.3f} -> fine-tuned {after:.3f}")


if __name__ == "__main__":
    main()
