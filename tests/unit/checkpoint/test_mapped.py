"""`MappedFile` (`lightning_dpar.checkpoint.mapped`): the pages of a memory-mapped checkpoint tensor leave this
process's resident set once released, its values stay readable, and memory outside the file's mapping is never
touched. Measured on the mapping's own `Rss` in `/proc/self/smaps` (Linux)."""

from __future__ import annotations

import mmap
import os

import pytest
import torch

from lightning_dpar.checkpoint.mapped import MappedFile

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc (Linux)")

MIB = 2**20


def resident_bytes(path: str) -> int:
    """This process's resident bytes of the mappings of `path`, from `/proc/self/smaps`."""
    real, total, inside = os.path.realpath(path), 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = len(fields) == 6 and fields[5] == real
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def test_a_released_tensor_leaves_the_resident_set_and_keeps_its_values(tmp_path):
    path = str(tmp_path / "full.pt")
    torch.save({"big": torch.arange(4 * MIB // 4, dtype=torch.float32), "small": torch.ones(3)}, path)
    loaded = torch.load(path, mmap=True, weights_only=True)
    mapped = MappedFile(path)
    assert mapped.ranges, "torch.load(mmap=True) maps the file"
    expected_sum = float(loaded["big"].double().sum())
    before = resident_bytes(path)
    assert before >= 4 * MIB - 64 * 1024  # the sum read every page
    mapped.release(loaded["big"])
    after = resident_bytes(path)
    assert before - after >= 4 * MIB - 2 * mmap.PAGESIZE, (before, after)  # all whole pages of its storage went
    assert float(loaded["big"].double().sum()) == expected_sum  # read again from the file
    assert torch.equal(loaded["small"], torch.ones(3))


def test_memory_outside_the_mapping_is_left_alone(tmp_path):
    path = str(tmp_path / "full.pt")
    torch.save({"w": torch.ones(MIB)}, path)
    torch.load(path, mmap=True, weights_only=True)
    heap = torch.full((MIB,), 7.0)  # released pages of heap memory would read back as zeros
    MappedFile(path).release(heap)
    assert bool((heap == 7.0).all())


def test_a_file_this_process_has_not_mapped_releases_nothing(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"w": torch.ones(4)}, path)
    mapped = MappedFile(str(path))
    assert mapped.ranges == []
    kept = torch.load(path, weights_only=True)["w"]  # read, not mapped
    mapped.release(kept)
    assert torch.equal(kept, torch.ones(4))
