"""Loading a checkpoint runs no code from it, and every unusable checkpoint fails naming the file and what to do:
the in-process tests of `lightning_dpar.checkpoint.safe_io` and its readers.

They build small real checkpoints with `dcp.save` (no process group) and hostile variants of them
(`tests/support/malicious.py`); each payload is first shown to run under DCP's own `pickle.load` or
`torch.load(weights_only=False)` (it creates a marker file), then to be refused by every reader of ours without the
marker appearing. The 2-rank Trainer cases (`fit(ckpt_path=...)`, memory-mapped full-format loads) are in
`tests/launched/test_checkpoint_safety.py` (workers in `tests/workers/checkpoint_safety.py`). The checkpoints are
`tests/support/checkpoint_files.py`'s; corrupt (not hostile) ones are `tests/unit/checkpoint/test_safe_io.py`,
`consolidate` on bad input `tests/unit/checkpoint/test_consolidate.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import pathlib
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import lightning_dpar
from lightning_dpar.checkpoint import safe_io
from lightning_dpar.checkpoint.errors import CheckpointLoadError, CorruptCheckpointError, UnsafeCheckpointError
from lightning_dpar.checkpoint.offline_reader import OfflineCheckpoint
from lightning_dpar.checkpoint.safe_io import read_dcp_index, translate_dcp_errors
from lightning_dpar.checkpoint.storage import Location
from tests.support import malicious
from tests.support.checkpoint_files import Tiny, copy_of, write_sharded


@pytest.fixture
def marker(tmp_path) -> Path:
    return tmp_path / "PAYLOAD_RAN"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return write_sharded(tmp_path_factory.mktemp("pristine") / "good.ckpt")


def ran(marker: Path) -> bool:
    return marker.exists()


def assert_refused(error: BaseException, file: Path, refers_to: str) -> None:
    message = str(error)
    assert isinstance(error, CheckpointLoadError), f"{type(error).__name__}: {message}"
    assert repr(str(file)) in message, message
    assert f"refers to {refers_to}" in message, message
    assert "Nothing from it was run" in message


# ---------------------------------------------------------------------- the index allowlist
ADMITTED = set(safe_io.INDEX_CLASSES) | set(safe_io._INDEX_VALUES) | {safe_io._LAYOUT_FUNCTION}


def test_real_indexes_refer_only_to_the_allowlist(tmp_path):
    """Indexes of every dtype, bytes leaves, `pathlib`/`str`/`file://` checkpoint ids and the fsspec writer: every
    global they name is admitted, and the index reads back equal to DCP's own `pickle.load`."""
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.uint8]
    dtypes += [torch.bool, torch.complex64, torch.float8_e4m3fn]
    state = {f"t{i}": torch.zeros(2, 3, dtype=d) for i, d in enumerate(dtypes)}
    state["leaves"] = {"lr": 0.1, "betas": (0.9, 0.99), "name": "x", "flag": True, "none": None, "ids": [1, 2]}
    state["channels_last"] = torch.zeros(1, 2, 3, 3).to(memory_format=torch.channels_last)
    checkpoints = {
        "path": tmp_path / "as_path",
        "str": str(tmp_path / "as_str"),
        "file_url": f"file://{tmp_path / 'as_url'}",
    }
    for name, checkpoint_id in checkpoints.items():
        dcp.save(state, checkpoint_id=checkpoint_id, no_dist=True)
        location = Location.parse(checkpoint_id)
        data = Path(location.path, ".metadata").read_bytes()
        assert malicious.globals_named(data) <= ADMITTED, name
        assert read_dcp_index(location) == pickle.loads(data), name
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "multi", single_file_per_rank=False), no_dist=True)
    assert read_dcp_index(Location.parse(tmp_path / "multi")).state_dict_metadata.keys() == state_keys(state)


def state_keys(state: dict) -> set[str]:
    keys = {k for k in state if k != "leaves"}
    return keys | {f"leaves.{k}" for k in state["leaves"]}


def test_allowlist_is_exact_pairs_without_functions_or_dotted_names():
    for module, name in safe_io.INDEX_CLASSES:
        assert "." not in name
        assert isinstance(getattr(__import__(module, fromlist=[name]), name), type), (module, name)
    unpickler = safe_io._DCPIndexUnpickler(io.BytesIO(b""))
    for module, name in [
        ("torch.distributed.checkpoint.metadata", "os.system"),
        ("torch.distributed.checkpoint.metadata", "Metadata.__init__"),
        ("torch.distributed.checkpoint.format_utils", "torch_save_to_dcp"),
        ("torch.distributed.checkpoint", "state_dict_saver"),
        ("torch.serialization", "load"),
        ("torch", "load"),
        ("builtins", "getattr"),
        ("pathlib", "Path.write_text"),
    ]:
        with pytest.raises(pickle.UnpicklingError, match="refers to|" + name.replace(".", r"\.")):
            unpickler.find_class(module, name)
    # Paths as other Pythons pickle them (3.13: `pathlib._local`; Windows: `WindowsPath`) build pure paths here.
    assert unpickler.find_class("pathlib._local", "PosixPath") is pathlib.PosixPath
    assert unpickler.find_class("pathlib", "WindowsPath") is pathlib.PureWindowsPath
    # The layout function is replaced by one that only maps layout names.
    assert unpickler.find_class("torch.serialization", "_get_layout")("torch.strided") is torch.strided
    with pytest.raises(pickle.UnpicklingError, match="not a torch layout"):
        unpickler.find_class("torch.serialization", "_get_layout")("os")


INDEX_PAYLOADS = list(malicious.index_payloads(Path("/x"), Path("/tmp")))


@pytest.mark.parametrize("kind", INDEX_PAYLOADS)
def test_hostile_index_runs_with_pickle_but_not_with_any_reader(pristine, tmp_path, marker, kind):
    """The payload creates the marker under DCP's own `pickle.load`; `fit`'s reader (`inspect_checkpoint`),
    `load_from_checkpoint` and `consolidate` refuse it, naming `.metadata` and what it refers to."""
    checkpoint = copy_of(pristine, tmp_path)
    index = checkpoint / ".metadata"
    payloads = malicious.index_payloads(marker, tmp_path)
    payload = payloads[kind] or malicious.nested_index(index.read_bytes(), marker)
    with contextlib.suppress(BaseException):  # DCP's own reader: what the payload returns is mostly no index
        dcp.load({}, storage_reader=dcp.FileSystemReader(_with_index(checkpoint, payload, tmp_path)), no_dist=True)
    assert ran(marker), "the payload must work for the test to mean anything"
    marker.unlink()
    index.write_bytes(payload)
    refers_to = {
        "dotted_filesystem_os_system": "torch.distributed.checkpoint.filesystem.os.system",
        "dotted_metadata_os_system": "torch.distributed.checkpoint.metadata.os.system",
        "function_of_dcp_module": "torch.distributed.checkpoint.format_utils.torch_save_to_dcp",
        "builtins_eval": "builtins.eval",
        "builtins_exec": "builtins.exec",
        "builtins_getattr": "builtins.getattr",
        "os_system": "os.system",
        "posix_system": "posix.system",
        "nested_pickle_loads": "pickle.loads",
        "nested_in_valid_index": "_pickle.loads",
    }[kind]
    for read in (
        lambda: read_dcp_index(Location.parse(checkpoint)),
        lambda: lightning_dpar.load_from_checkpoint(Tiny, checkpoint),
        lambda: OfflineCheckpoint(str(checkpoint)),
    ):
        with pytest.raises(UnsafeCheckpointError) as caught:
            read()
        assert_refused(caught.value, index, refers_to)
        assert not ran(marker)
    assert "there is nothing to allow" in str(caught.value)


def _with_index(checkpoint: Path, payload: bytes, tmp_path: Path) -> Path:
    """A copy of `checkpoint` with `payload` as its index, for the plain-pickle control run."""
    control = tmp_path / "control"
    shutil.copytree(checkpoint, control)
    (control / ".metadata").write_bytes(payload)
    return control


def test_index_pointing_outside_the_checkpoint_is_refused(pristine, tmp_path):
    """A crafted index cannot make the readers open files outside the checkpoint directory."""
    checkpoint = copy_of(pristine, tmp_path)
    index = pickle.loads((checkpoint / ".metadata").read_bytes())  # our own freshly written index
    next(iter(index.storage_data.values())).relative_path = "../../etc/passwd"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(index))
    with pytest.raises(CorruptCheckpointError, match=r"points at the data file '\.\./\.\./etc/passwd', outside"):
        read_dcp_index(Location.parse(checkpoint))


# ---------------------------------------------------------------------- torch.save files: meta.pt, full, leaves
TORCH_SAVE_PAYLOADS = list(malicious.torch_save_payloads(Path("/x")))
REFERS_TO = {"os_system": "posix.system", "builtins_eval": "builtins.eval", "nested_pickle": "pickle.loads"}


def _payload_file(marker: Path, kind: str, tmp_path: Path) -> bytes:
    data = malicious.saved(malicious.torch_save_payloads(marker)[kind])
    torch.load(io.BytesIO(data), weights_only=False)  # the control: unrestricted loading runs it
    assert ran(marker), "the payload must work for the test to mean anything"
    marker.unlink()
    return data


@pytest.mark.parametrize("kind", TORCH_SAVE_PAYLOADS)
def test_hostile_meta_pt_is_refused(pristine, tmp_path, marker, kind):
    checkpoint = copy_of(pristine, tmp_path)
    (checkpoint / "meta.pt").write_bytes(_payload_file(marker, kind, tmp_path))
    for read in (
        lambda: lightning_dpar.load_from_checkpoint(Tiny, checkpoint),
        lambda: OfflineCheckpoint(str(checkpoint)),
    ):
        with pytest.raises(UnsafeCheckpointError) as caught:
            read()
        assert_refused(caught.value, checkpoint / "meta.pt", REFERS_TO[kind])
        assert "torch.serialization.add_safe_globals([YourType])" in str(caught.value)
    assert not ran(marker)


@pytest.mark.parametrize("kind", TORCH_SAVE_PAYLOADS)
def test_hostile_full_format_file_is_refused(tmp_path, marker, kind):
    file = tmp_path / "full.ckpt"
    file.write_bytes(_payload_file(marker, kind, tmp_path))
    from lightning_dpar.checkpoint.full import read_full

    for read in (lambda: lightning_dpar.load_from_checkpoint(Tiny, file), lambda: read_full(Location.parse(file))):
        with pytest.raises(UnsafeCheckpointError) as caught:
            read()
        assert_refused(caught.value, file, REFERS_TO[kind])
    assert not ran(marker)


@pytest.mark.parametrize("kind", TORCH_SAVE_PAYLOADS)
def test_hostile_distcp_leaf_is_refused_before_reading(pristine, tmp_path, marker, kind):
    """A non-tensor leaf (an optimizer hyperparameter) replaced by a hostile `torch.save`, checksums updated."""
    checkpoint = copy_of(pristine, tmp_path)
    fqn, data_file = malicious.poison_item(checkpoint, _payload_file(marker, kind, tmp_path))
    for read in (
        lambda: lightning_dpar.load_from_checkpoint(Tiny, checkpoint),
        lambda: OfflineCheckpoint(str(checkpoint)),
    ):
        with pytest.raises(CheckpointLoadError) as caught:  # found by the ranks' vetting, before any collective
            read()
        assert_refused(caught.value, checkpoint / data_file, REFERS_TO[kind])
        assert f"the non-tensor item {fqn!r}" in str(caught.value)
    assert not ran(marker)


def test_hostile_distcp_tensor_is_refused_during_the_read_naming_the_file(pristine, tmp_path, marker):
    """A tensor item is read by DCP itself (`weights_only`): the refusal comes out of `dcp.load` as DCP's
    `CheckpointException` (a BaseException), which `translate_dcp_errors` turns into our error naming the file."""
    checkpoint = copy_of(pristine, tmp_path)
    malicious.poison_item(checkpoint, _payload_file(marker, "os_system", tmp_path), tensor=True)
    with pytest.raises(UnsafeCheckpointError) as caught:
        lightning_dpar.load_from_checkpoint(Tiny, checkpoint)
    message = str(caught.value)
    assert message.startswith(f"Checkpoint load of {str(checkpoint)!r} failed on rank 0: In ")
    assert_refused(caught.value, checkpoint / "__0_0.distcp", "posix.system")
    assert not ran(marker)


def test_translate_dcp_errors_reports_every_rank_once(tmp_path):
    location = Location.parse(tmp_path)
    same = CorruptCheckpointError("'/c/__0_0.distcp' is truncated")
    failures = {0: (same, None), 1: (same, None), 3: (OSError(28, "No space left on device"), None)}
    with pytest.raises(CheckpointLoadError) as caught, translate_dcp_errors(location, "save"):
        raise dcp.CheckpointException("write", failures)
    assert str(caught.value) == (
        f"Checkpoint save of {str(tmp_path)!r} failed on ranks 0, 1: '/c/__0_0.distcp' is truncated; rank 3:"
        " OSError: [Errno 28] No space left on device"
    )
    with pytest.raises(CorruptCheckpointError), translate_dcp_errors(location):  # one kind of cause: kept
        raise dcp.CheckpointException("read", {0: (same, None)})
    with pytest.raises(UnsafeCheckpointError, match=r"refers to posix\.system"), translate_dcp_errors(location):
        raise pickle.UnpicklingError("Unsupported global: GLOBAL posix.system was not an allowed global by default.")


# ---------------------------------------------------------------------- a type of the user's own
@dataclasses.dataclass
class Config:
    """A hyperparameter type of the user's own, which `meta.pt` holds only once allowed."""

    depth: int


def test_users_own_types_load_once_allowed(pristine, tmp_path):
    """The documented way to allow a hyperparameter type of one's own in `meta.pt`."""
    checkpoint = copy_of(pristine, tmp_path)
    meta = torch.load(checkpoint / "meta.pt", weights_only=True)
    meta["hyper_parameters"]["config"] = Config(depth=2)
    torch.save(meta, checkpoint / "meta.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"refers to tests\.unit\.checkpoint\.test_safety\.Config"):
        lightning_dpar.load_from_checkpoint(Tiny, checkpoint)
    with torch.serialization.safe_globals([Config]):
        model = lightning_dpar.load_from_checkpoint(Tiny, checkpoint)
    assert model.hparams.config == Config(depth=2)
    assert torch.equal(model.layer.weight, OfflineCheckpoint(str(pristine)).read_tensor("layer.weight"))
