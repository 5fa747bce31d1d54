"""Where a checkpoint lives: a local directory or an fsspec URL (`s3://`, `gs://`, `memory://`, `file://`).

Everything that touches the filesystem goes through `Location`, so the save, load and cleanup code is the same for
local disks and object stores. Local paths (including `file://` URLs) use plain `os` calls, which DCP's
`FileSystemWriter` also uses; other protocols go through fsspec (and DCP's fsspec writer, picked from the URL).
"""

from __future__ import annotations

import io
import os
import posixpath
import shutil
from dataclasses import dataclass
from typing import IO, Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

__all__ = [
    "Location",
]


@dataclass(frozen=True)
class Location:
    """A path on one filesystem. `path` is the filesystem-internal path (no protocol for local paths)."""

    fs: fsspec.AbstractFileSystem
    path: str

    @classmethod
    def parse(cls, path: str | os.PathLike[str]) -> Location:
        fs, inner = fsspec.core.url_to_fs(str(path))
        return cls(fs, inner)

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    @property
    def url(self) -> str:
        """What DCP and users see: a plain path locally, a full URL otherwise."""
        return self.path if self.is_local else self.fs.unstrip_protocol(self.path)

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> Location:
        return Location(self.fs, posixpath.dirname(self.path.rstrip("/")) or "/")

    def child(self, name: str) -> Location:
        return Location(self.fs, f"{self.path.rstrip('/')}/{name}")

    def sibling(self, name: str) -> Location:
        return self.parent.child(name)

    def exists(self) -> bool:
        return self.fs.exists(self.path)

    def is_dir(self) -> bool:
        return self.fs.isdir(self.path)

    def size(self) -> int:
        return int(self.fs.size(self.path))

    def list_names(self) -> list[str]:
        if not self.is_dir():
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.path, detail=False))

    def open(self, mode: str) -> IO[Any]:
        return self.fs.open(self.path, mode)

    def write_torch(self, obj: Any) -> None:
        """`torch.save` `obj` into this file (serialised in memory first: fsspec files may not be seekable)."""
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        with self.open("wb") as f:
            f.write(buffer.getvalue())

    def makedirs(self) -> None:
        self.fs.makedirs(self.path, exist_ok=True)

    def remove(self) -> None:
        """Delete a file or a whole directory; a missing path is not an error."""
        if self.is_local:
            if os.path.isdir(self.path) and not os.path.islink(self.path):
                shutil.rmtree(self.path, ignore_errors=True)
            elif os.path.lexists(self.path):
                os.remove(self.path)
        elif self.exists():
            self.fs.rm(self.path, recursive=True)

    def rename_to(self, target: Location) -> None:
        """Move this directory to `target` (which must not exist). Atomic on a local filesystem (`os.rename`)."""
        if self.is_local:
            os.rename(self.path, target.path)
        else:
            self.fs.mv(self.path, target.path, recursive=True)
