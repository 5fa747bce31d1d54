"""Reading fused mixture-of-experts parameters from per-expert checkpoint tensors, each rank only its block.

A `save_pretrained` directory of a transformers MoE model stores `mlp.experts.3.gate_proj.weight` and its siblings,
one tensor per expert and projection, while the model holds `mlp.experts.gate_up_proj` [E, 2I, H]
(`lightning_dpar.experts.keys`). `FusedExpertsReader` is DCP's `HuggingFaceStorageReader` with each fused parameter
added to the checkpoint's metadata as one more tensor. DCP plans the load as for any tensor: every rank asks for the
block of the fused tensor its shard is (an FSDP shard of the experts, an expert-parallel share, both at once, or the
whole tensor), and the reader fills that block from the per-expert tensors it spans, reading of each only the rows
and columns inside the block (`safe_open(...).get_slice`). No rank reads an expert it does not hold, and the fused
tensor is never assembled anywhere. The other tensors are read by `HuggingFaceStorageReader` itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from contextlib import ExitStack

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from lightning_dpar.experts.keys import FusedExperts, pieces

__all__ = ["FusedExpertsReader"]


class FusedExpertsReader(HuggingFaceStorageReader):
    """`HuggingFaceStorageReader(path)` that also serves each of `fused` (`{key: FusedExperts}`, the key the load asks
    for) from its per-expert tensors. `stored` maps a per-expert name as `FusedExperts` holds it to its name in the
    files (transformers' renames; `lightning_dpar.hf_weights.hf_keys`), `files` that name to the safetensors file
    holding it. `slices_read` lists what this rank read of the per-expert tensors, `'name[0:16, 0:32]'` per slice."""

    def __init__(
        self, path: str, fused: Mapping[str, FusedExperts], stored: Mapping[str, str], files: Mapping[str, str]
    ) -> None:
        super().__init__(path)
        self.fused = dict(fused)
        self.stored = dict(stored)
        self.files = dict(files)
        self.slices_read: list[str] = []

    def read_metadata(self) -> Metadata:
        metadata = super().read_metadata()
        for key, group in self.fused.items():
            first = metadata.state_dict_metadata[self.stored[group.first_key]]
            size = torch.Size(group.shape)
            chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)
            metadata.state_dict_metadata[key] = TensorStorageMetadata(first.properties, size, [chunk])
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        ours = [item for item in plan.items if item.storage_index.fqn in self.fused]
        theirs = [item for item in plan.items if item.storage_index.fqn not in self.fused]
        super().read_data(dataclasses.replace(plan, items=theirs), planner).wait()
        with ExitStack() as files:
            opened: dict[str, object] = {}
            for item in ours:
                self._read_block(item, planner, files, opened)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_block(self, item: ReadItem, planner: LoadPlanner, files: ExitStack, opened: dict[str, object]) -> None:
        """Fill the block `item` asks for from the per-expert slices inside it."""
        from safetensors import safe_open

        group = self.fused[item.storage_index.fqn]
        target = planner.resolve_tensor(item).detach()
        for piece in pieces(group, item.storage_offsets, item.lengths):
            name = self.stored[piece.key]
            file = self.files[name]
            if file not in opened:
                opened[file] = files.enter_context(safe_open(file, framework="pt"))
            target[piece.dest].copy_(opened[file].get_slice(name)[piece.source])
            self.slices_read.append(f"{name}[{', '.join(f'{s.start}:{s.stop}' for s in piece.source)}]")
        planner.commit_tensor(item, target)
