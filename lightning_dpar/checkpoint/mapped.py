"""Giving back the pages of a memory-mapped checkpoint file once their content has been copied out.

`torch.load(mmap=True)` maps a full-format file instead of reading it, but every page a rank touches stays in its
resident set until the whole mapping goes, and the kernel maps file pages in large blocks (a read of the first
rows of a tensor can map all of it). A rank that copies its shard out of each tensor in turn would so end up with the
whole file resident. `MappedFile.release(tensor)` drops the pages of one tensor's storage from this process's page
tables (`madvise(MADV_DONTNEED)`): the mapping is private and read-only in use, so a later read simply maps the
file's pages again. Only storages that lie inside the file's own mapping are touched; anything else (a tensor
allocated on the heap, a remote file read into memory) is left alone, since dropping heap pages would lose data.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

__all__ = ["MappedFile"]

_MADV_DONTNEED = 4  # Linux


class MappedFile:
    """The address ranges at which this process maps the file `path` (Linux; elsewhere nothing is released)."""

    def __init__(self, path: str) -> None:
        self.ranges: list[tuple[int, int]] = []
        real = os.path.realpath(path)
        try:
            with open("/proc/self/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].strip() == real:
                        start, end = (int(x, 16) for x in fields[0].split("-"))
                        self.ranges.append((start, end))
        except OSError:
            return
        self._madvise = ctypes.CDLL(None, use_errno=True).madvise if self.ranges else None

    def release(self, tensor: torch.Tensor) -> None:
        """Drop the whole pages of `tensor`'s storage from this process's resident set, if it lies in the file's
        mapping; its content stays readable (from the file)."""
        if self._madvise is None:
            return
        storage = tensor.untyped_storage()
        start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        if not any(low <= start and end <= high for low, high in self.ranges):
            return
        page = mmap.PAGESIZE
        first, last = -(-start // page) * page, end // page * page
        if last > first:
            self._madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)
