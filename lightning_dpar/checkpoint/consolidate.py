"""`consolidate CKPT_DIR OUT [--format lightning|safetensors|hf] [--strip-prefix P] [--max-shard-size 5GB]`

Turns a sharded checkpoint (lightning_dpar, Lightning's `ModelParallelStrategy` or
`FSDPStrategy(state_dict_type="sharded")`) into:

- `--format lightning` (default): one Lightning `.ckpt` file, optimizer state included and keyed by parameter
  position like a plain optimizer's, which `LightningModule.load_from_checkpoint` and
  `Trainer(strategy="auto").fit(ckpt_path=OUT)` on one device accept. It holds the whole model, so building it
  needs the model's size in memory.
- `--format safetensors`: the model weights as safetensors files of at most `--max-shard-size` each in the directory
  OUT (`model.safetensors`, or `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`). Tensors are
  read and written one at a time: peak memory is about the largest tensor, not the model. Names are relative to
  the LightningModule (`model.layers.0...`); `--strip-prefix model.` removes the attribute's name.
- `--format hf`: a directory `transformers`' `from_pretrained` loads: the weights of the LightningModule's
  `PreTrainedModel`, prefix stripped, checked against that class, streamed the same way, with its `config.json` and
  `generation_config.json` (see `lightning_dpar.checkpoint.hf_export`). With `--merge-adapters`, a peft model's
  adapters merged into its base (`merge_and_unload`); an adapter-only checkpoint takes its base from `--base DIR`.
- `--format peft`: `adapter_model.safetensors` and `adapter_config.json` of the checkpoint's peft adapter, which
  `PeftModel.from_pretrained(base, OUT)` loads (see `lightning_dpar.checkpoint.peft_export`).

Runs in one process, no GPU or process group needed: `python -m lightning_dpar consolidate ...` or
`python -m lightning_dpar.checkpoint.consolidate ...`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import struct
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

import lightning_dpar.checkpoint.hf_export as hf_export
import lightning_dpar.checkpoint.peft_export as peft_export
from lightning_dpar.checkpoint.adapter_only import refuse_without_base
from lightning_dpar.checkpoint.errors import CheckpointLoadError
from lightning_dpar.checkpoint.offline_reader import OfflineCheckpoint
from lightning_dpar.experts.keys import ExpertPart

__all__ = [
    "main",
]

_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """`"5GB"` -> 5e9 bytes; decimal (KB, MB, GB) and binary (KiB, MiB, GiB) units."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use a number with a unit, e.g. 5GB, 500MB, 2GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def write_lightning(checkpoint: OfflineCheckpoint, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint.lightning_checkpoint(), out)


def write_safetensors(
    checkpoint: OfflineCheckpoint,
    out: Path,
    max_shard_size: int,
    tensor_names: Mapping[str, str | ExpertPart] | None = None,
) -> list[Path]:
    """Stream the model's tensors into safetensors files; headers are computed from the index up front.

    `tensor_names` maps each output name to its checkpoint name (default: every tensor under its own name), or to an
    `ExpertPart` of one (one expert's rows of a fused expert parameter): the parts of one fused tensor follow each
    other, so it is read once for all of them."""
    stored = checkpoint.model_tensors()
    tensor_names = tensor_names if tensor_names is not None else {name: name for name in stored}
    layout: dict[str, tuple[list[int], torch.dtype]] = {}
    for name, source in tensor_names.items():
        meta = stored[source if isinstance(source, str) else source.name]
        shape = list(meta.size) if isinstance(source, str) else list(source.shape(meta.size))
        if meta.properties.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{name!r} has dtype {meta.properties.dtype}, which safetensors cannot store.")
        layout[name] = (shape, meta.properties.dtype)
    nbytes = {name: math.prod(shape) * dtype.itemsize for name, (shape, dtype) in layout.items()}
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for name in layout:
        if shards[-1] and shard_bytes + nbytes[name] > max_shard_size:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += nbytes[name]
    out.mkdir(parents=True, exist_ok=True)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    written = []
    reader = _TensorReader(checkpoint)
    for file_name, shard in zip(names, shards):
        header: dict[str, dict] = {"__metadata__": {"format": "pt"}}  # type: ignore[dict-item]
        offset = 0
        for name in shard:
            shape, dtype = layout[name]
            header[name] = {
                "dtype": _SAFETENSORS_DTYPES[dtype],
                "shape": shape,
                "data_offsets": [offset, offset + nbytes[name]],
            }
            offset += nbytes[name]
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned
        with open(out / file_name, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)))
            f.write(encoded)
            for name in shard:
                tensor = reader.read(tensor_names[name]).contiguous()
                if tensor.numel():
                    f.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))  # no extra copy
                del tensor
        written.append(out / file_name)
    if len(shards) > 1:
        weight_map = {name: file_name for file_name, shard in zip(names, shards) for name in shard}
        index = {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return written


class _TensorReader:
    """Reads checkpoint tensors one at a time, keeping the last fused expert tensor for its next parts."""

    def __init__(self, checkpoint: OfflineCheckpoint) -> None:
        self.checkpoint = checkpoint
        self.kept: tuple[str, torch.Tensor] | None = None

    def read(self, source: str | ExpertPart) -> torch.Tensor:
        if isinstance(source, str):
            self.kept = None
            return self.checkpoint.read_tensor(source)
        if self.kept is None or self.kept[0] != source.name:
            self.kept = None  # freed before the next one is read
            self.kept = (source.name, self.checkpoint.read_tensor(source.name))
        return self.kept[1][source.index()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="consolidate",
        description="Convert a sharded checkpoint directory into one Lightning .ckpt or safetensors files.",
    )
    parser.add_argument("ckpt_dir", help="sharded checkpoint directory (local path or fsspec URL)")
    parser.add_argument("out", help="output .ckpt file (lightning) or output directory (safetensors)")
    parser.add_argument("--format", choices=["lightning", "safetensors", "hf", "peft"], default="lightning")
    parser.add_argument(
        "--strip-prefix",
        default=None,
        help="safetensors: remove this prefix (e.g. 'model.') from every tensor name; hf strips it automatically",
    )
    parser.add_argument(
        "--max-shard-size", type=parse_size, default=parse_size("5GB"), help="safetensors file size limit (5GB)"
    )
    parser.add_argument("--merge-adapters", action="store_true", help="hf: merge a peft model's adapters into it")
    parser.add_argument(
        "--base", default=None, help="hf --merge-adapters of an adapter-only checkpoint: base model dir"
    )
    parser.add_argument("--adapter", default=None, help="peft, --merge-adapters: which adapter (default: the only one)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `consolidate`; returns the process exit code (0 success, 1 unusable input or output).

    Any unusable input (a missing path, a file, a directory that is not a complete sharded checkpoint, a corrupt or
    unsafe one, a checkpoint without the model `--format hf` needs) or unwritable output is one line on stderr
    naming it and what was expected, never a traceback.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.strip_prefix is not None and args.format != "safetensors":
        parser.error("--strip-prefix applies to --format safetensors only (--format hf strips the prefix itself)")
    if args.merge_adapters and args.format != "hf":
        parser.error("--merge-adapters applies to --format hf only (--format peft writes the adapter alone)")
    if args.base is not None and not args.merge_adapters:
        parser.error("--base applies to --format hf --merge-adapters only (the adapter export needs no base)")
    try:
        checkpoint = OfflineCheckpoint(args.ckpt_dir)
        if args.format in ("lightning", "hf") and not args.merge_adapters:  # a model without its base: refused
            refuse_without_base(checkpoint.info.dpar_record, checkpoint.info.location.url, f"--format {args.format}")
        if args.format == "lightning":
            write_lightning(checkpoint, Path(args.out))
            written = [Path(args.out)]
        elif args.format == "peft":
            written = peft_export.export_peft(checkpoint, Path(args.out), args.adapter)
        elif args.merge_adapters:
            written = peft_export.export_merged(checkpoint, Path(args.out), args.base, args.adapter)
        else:
            written = write_weights(checkpoint, Path(args.out), args.format, args.strip_prefix, args.max_shard_size)
    except (CheckpointLoadError, hf_export.ExportError, OSError, ValueError) as error:
        print(f"consolidate: {_one_line(error)}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0


def _one_line(error: BaseException) -> str:
    """The message on one line; an `OSError` (e.g. an unwritable output) keeps its type, and names its path."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if isinstance(error, OSError) else text


def write_weights(
    checkpoint: OfflineCheckpoint, out: Path, fmt: str, prefix: str | None, max_shard_size: int
) -> list[Path]:
    """`--format safetensors` (optionally with `--strip-prefix`) or `--format hf`; checks before writing anything."""
    stored = checkpoint.model_tensors()
    if fmt == "safetensors":
        names = hf_export.strip_prefix(list(stored), prefix) if prefix else None
        return write_safetensors(checkpoint, out, max_shard_size, names)
    record = hf_export.require_record(checkpoint.info.metadata, checkpoint.info.location.url)
    shapes = {name: tuple(meta.size) for name, meta in stored.items()}
    names, left_out = hf_export.hf_tensor_names(record, shapes)
    if left_out:
        print(f"not part of the {record['class']}, not exported: {left_out}")
    return [*write_safetensors(checkpoint, out, max_shard_size, names), *hf_export.write_configs(record, out)]


if __name__ == "__main__":
    sys.exit(main())
