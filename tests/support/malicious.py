"""Hostile checkpoint content for the safety tests: pickles that create a marker file when unpickled.

Every payload runs `touch MARKER` (through `os.system`, `eval`, `exec`, a nested pickle or a DCP function) when
unpickled by a loader that admits what it names; a test shows the payload works with a plain `pickle.loads`, then
that no loader of ours runs it (the marker never appears) and that the refusal names the file.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import zlib
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata


# ---------------------------------------------------------------------- raw pickle assembly (protocol 4)
def _text(value: str) -> bytes:
    data = value.encode()
    return b"X" + struct.pack("<I", len(data)) + data  # BINUNICODE


def _bytes(value: bytes) -> bytes:
    return b"B" + struct.pack("<I", len(value)) + value  # BINBYTES


def _global(module: str, name: str) -> bytes:
    return _text(module) + _text(name) + b"\x93"  # STACK_GLOBAL: protocol 4 resolves dotted names


def _call(function: bytes, *args: bytes) -> bytes:
    return function + b"(" + b"".join(args) + b"tR"  # MARK args TUPLE REDUCE


def _pickle(body: bytes) -> bytes:
    return b"\x80\x04" + body + b"."  # PROTO 4 ... STOP


def shell(marker: Path) -> str:
    return f"touch {marker}"


def index_payloads(marker: Path, work: Path) -> dict[str, bytes]:
    """Pickles to put in place of a DCP `.metadata` index, by kind of attack."""
    command = shell(marker)
    inner = _pickle(_call(_global("os", "system"), _text(command)))
    # A torch.save file whose pickle runs the command when loaded with weights_only=False (DCP's own helper does).
    evil_pt = work / "evil_for_format_utils.pt"
    torch.save(RunsCommand(command), evil_pt)
    import_os = _call(_global("builtins", "__import__"), _text("os"))
    return {
        # protocol-4 dotted names: an allowed-looking module, then attributes through its own imports
        "dotted_filesystem_os_system": _pickle(
            _call(_global("torch.distributed.checkpoint.filesystem", "os.system"), _text(command))
        ),
        "dotted_metadata_os_system": _pickle(
            _call(_global("torch.distributed.checkpoint.metadata", "os.system"), _text(command))
        ),
        # a plain function of an allowed-looking module: loads a torch.save file with weights_only=False
        "function_of_dcp_module": _pickle(
            _call(
                _global("torch.distributed.checkpoint.format_utils", "torch_save_to_dcp"),
                _text(str(evil_pt)),
                _text(str(work / "converted")),
            )
        ),
        # __reduce__ of builtins
        "builtins_eval": _pickle(_call(_global("builtins", "eval"), _text(f"__import__('os').system({command!r})"))),
        "builtins_exec": _pickle(_call(_global("builtins", "exec"), _text(f"import os; os.system({command!r})"))),
        "builtins_getattr": _pickle(
            _call(_call(_global("builtins", "getattr"), import_os, _text("system")), _text(command))
        ),
        "os_system": inner,
        "posix_system": _pickle(_call(_global("posix", "system"), _text(command))),
        # nested pickles: pickle.loads of another pickle, plain and inside an otherwise valid index
        "nested_pickle_loads": _pickle(_call(_global("pickle", "loads"), _bytes(inner))),
        "nested_in_valid_index": b"",  # filled by `nested_index` from a real index
    }


def nested_index(real_index: bytes, marker: Path) -> bytes:
    """A real DCP index whose `planner_data` also holds `pickle.loads(<pickle running the command>)`."""
    metadata = pickle.loads(real_index)  # our own freshly written index
    inner = _pickle(_call(_global("os", "system"), _text(shell(marker))))
    metadata.planner_data = {**(metadata.planner_data or {}), "extra": NestedPickle(inner)}
    return pickle.dumps(metadata, protocol=4)


class RunsCommand:
    """Pickles as `os.system(command)`: what a hostile `torch.save` file contains."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class Evaluates:
    """Pickles as `builtins.eval(...)`."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return eval, (f"__import__('os').system({self.command!r})",)


class NestedPickle:
    """Pickles as `pickle.loads(inner)`: a pickle inside allowed-looking content."""

    def __init__(self, inner: bytes) -> None:
        self.inner = inner

    def __reduce__(self):
        return pickle.loads, (self.inner,)


def torch_save_payloads(marker: Path) -> dict[str, object]:
    """Objects whose `torch.save` files run the command when loaded without `weights_only`."""
    command = shell(marker)
    inner = _pickle(_call(_global("os", "system"), _text(command)))
    return {
        "os_system": RunsCommand(command),
        "builtins_eval": Evaluates(command),
        "nested_pickle": NestedPickle(inner),
    }


def globals_named(data: bytes) -> set[tuple[str, str]]:
    """Every (module, name) a trusted pickle refers to, resolved while unpickling it with Python's own unpickler."""
    seen: set[tuple[str, str]] = set()

    class Recorder(pickle._Unpickler):  # the pure-Python unpickler: every global goes through find_class
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    Recorder(io.BytesIO(data)).load()
    return seen


def saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


# ---------------------------------------------------------------------- tampering with a real sharded checkpoint
def poison_item(checkpoint: Path, payload: bytes, tensor: bool = False) -> tuple[str, str]:
    """Point the first non-tensor (or tensor) item of `checkpoint` at `payload`, appended to its `.distcp` file,
    and update the index and the recorded checksums the way an attacker controlling every file would.
    Returns the item's name and its data file's name."""
    index_file = checkpoint / ".metadata"
    index = pickle.loads(index_file.read_bytes())  # our own freshly written index
    wanted = TensorStorageMetadata if tensor else BytesStorageMetadata
    key, storage = next(
        (k, s) for k, s in index.storage_data.items() if isinstance(index.state_dict_metadata[k.fqn], wanted)
    )
    data_file = checkpoint / storage.relative_path
    storage.offset = data_file.stat().st_size
    storage.length = len(payload)
    with open(data_file, "ab") as f:
        f.write(payload)
    index_file.write_bytes(pickle.dumps(index, protocol=4))
    update_checksums(checkpoint)
    return key.fqn, storage.relative_path


def update_checksums(checkpoint: Path) -> None:
    """Rewrite `meta.pt`'s recorded size/crc32 of every data file to match the files as they are now."""
    meta_file = checkpoint / "meta.pt"
    meta = torch.load(meta_file, weights_only=True)
    files = meta.get("dpar", {}).get("files")
    if files:
        for name in files:
            data = (checkpoint / name).read_bytes()
            files[name] = (len(data), zlib.crc32(data))
        torch.save(meta, meta_file)
