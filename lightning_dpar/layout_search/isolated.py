"""The layout search where training will run: in a forked copy of this process, which ends with the search.

The search plans each candidate mesh with the dry run, on a fake process group of N ranks, which torch can only
create in a process without a default group. A second `dpar_auto` Trainer in a process whose first Trainer started
the real group (or a Ray Train worker, whose group Ray starts before the training function) would fail there. And a
process about to train should not host the fake worlds at all: the device meshes they build leave process-group
names behind, and a later real mesh's DTensors can resolve to groups that no longer exist (seen on 4 gloo ranks:
"Could not resolve the process group registered under the name 3" when gathering a 2-D state dict).
`AutoParallelStrategy` therefore always searches in a child (`in_child=True`).

The child is a fork (`os.fork`), not a fresh interpreter: it holds the user's model as this process holds it, so a
`LightningModule` defined in the user's script (`__main__`), in a notebook, or sent to a Ray worker by value needs no
import by name, and nothing is written to a file another process could replace. In the child the process groups
inherited from this process are forgotten, never used or shut down (`_private_api.forget_inherited_process_groups`),
nothing it inherited is ever garbage-collected (the destructors of this process's objects join threads the child
does not have), and it runs on one CPU thread, on meta tensors only (no accelerator call: a CUDA context does not
survive a fork).
Its answer comes back through a pipe only the two processes hold; it leaves with `os._exit`, running none of this
process's exit hooks, and if this process dies first, it stops within a second instead of finishing a search nobody
reads. The documented refusals (`ValueError`, `TypeError`: a bad size, a plan that cannot run) are raised here with
their own message; anything else fails with the child's traceback.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import lightning as L
import torch
import torch.distributed as dist

from lightning_dpar._private_api import forget_inherited_process_groups
from lightning_dpar.layout_search.probe import search_model
from lightning_dpar.layout_search.search import SearchResult

__all__ = ["run_in_fork", "search_anywhere"]

T = TypeVar("T")

#: The exceptions a search raises by design (a bad size, a plan that cannot run), re-raised here as they are.
_REFUSALS: dict[str, type[Exception]] = {"ValueError": ValueError, "TypeError": TypeError}


def search_anywhere(module: L.LightningModule, *args: Any, in_child: bool = False, **kwargs: Any) -> SearchResult:
    """`search_model(module, *args, **kwargs)`, in this process when it has no process group and `in_child` is
    false, else in a forked child (`run_in_fork`)."""
    if not in_child and not dist.is_initialized():
        return search_model(module, *args, **kwargs)
    return run_in_fork(search_model, module, *args, **kwargs)


def run_in_fork(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`function(*args, **kwargs)` in a forked child of this process; its result (pickled through a pipe) or its
    `ValueError` / `TypeError` (re-raised here with the same message)."""
    if not hasattr(os, "fork"):
        raise RuntimeError(
            f"`dpar_auto` searches the layouts in a forked process, which {sys.platform} cannot create. Choose the"
            " layout with `python -m lightning_dpar plan --auto ...` and give its sizes to"
            " `FSDPTensorParallelStrategy`."
        )
    _flush_output()  # else what this process has buffered would be written twice, once by the child
    read_end, write_end = os.pipe()
    parent = os.getpid()
    try:
        child = _fork_without_collecting()
    except OSError as error:  # e.g. ENOMEM under strict memory overcommit, with a large model in CPU memory
        os.close(read_end)
        os.close(write_end)
        raise RuntimeError(
            f"`dpar_auto` could not fork its layout search ({error}). Choose the layout with"
            " `python -m lightning_dpar plan --auto ...` and give its sizes to `FSDPTensorParallelStrategy`."
        ) from error
    if child == 0:
        try:
            os.close(read_end)
            _child_main(function, args, kwargs, write_end, parent)
        finally:
            os._exit(70)  # whatever went wrong, the child never returns into the caller's code
    os.close(write_end)
    reaped = False
    try:
        with os.fdopen(read_end, "rb") as pipe:
            answer = pipe.read()
        _, status = os.waitpid(child, 0)
        reaped = True
    finally:
        if not reaped:  # interrupted (Ctrl-C in a notebook): nobody will read the search
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
    if not answer:
        raise RuntimeError(
            f"The layout search's child process (pid {child}) ended without an answer ({_describe(status)}); its"
            " output above says why."
        )
    kind, value = pickle.loads(answer)  # written by the child through a pipe no other process holds
    if kind == "result":
        return value
    if kind in _REFUSALS:
        raise _REFUSALS[kind](value)
    raise RuntimeError(f"The layout search in a child process failed:\n{value}")


def _fork_without_collecting() -> int:
    """`os.fork()`, after which the child never collects what it inherited: the parent's unreachable objects (a
    finished Trainer's process group or checkpoint writer, waiting for the parent's next collection) would run their
    destructors in the child, which join threads that exist only in the parent (the child hangs or crashes: a gloo
    group's hangs; a search died by signal 11 on torch 2.11). The cyclic collector is off from before the fork until
    the child has frozen every inherited object (`gc.freeze`); the parent's collector is as it was."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        child = os.fork()
        if child == 0:
            gc.freeze()  # the child's own objects are still collected
    finally:
        if collecting:
            gc.enable()
    return child


def _child_main(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], write_end: int, parent: int
) -> None:
    """The child's whole life: the call, its answer written to the pipe, and `os._exit`."""
    code = 0
    _report_crashes()
    try:
        threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
        forget_inherited_process_groups()
        torch.set_num_threads(1)  # a fork inherits no OpenMP thread pool to run on
        outcome: tuple[str, Any] = ("result", function(*args, **kwargs))
    except (ValueError, TypeError) as err:
        outcome = ("TypeError" if isinstance(err, TypeError) else "ValueError", str(err))
    except BaseException:
        outcome = ("error", traceback.format_exc())
    try:
        answer = pickle.dumps(outcome)
    except Exception:
        answer = pickle.dumps(("error", traceback.format_exc()))
    try:
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(answer)
    except BaseException:  # the parent is gone: nobody to answer
        code = 1
    _flush_output()
    os._exit(code)


def _report_crashes() -> None:
    """A crash of the child (a signal, which leaves no answer) prints every thread's Python stack to its standard
    error, so the caller's error ("its output above says why") has something above it."""
    try:
        faulthandler.enable(file=sys.stderr, all_threads=True)
    except (AttributeError, OSError, ValueError):  # a standard error without a file descriptor (some notebooks)
        pass


def _flush_output() -> None:
    """Flush standard output and error, whatever they are (closed, replaced, a broken pipe)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except BaseException:  # output that cannot be flushed is lost, not a reason to fail
            pass


def _exit_with(parent: int) -> None:
    """Stop the child once its parent is gone (killed by its launcher, say): nobody would read its answer."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _describe(status: int) -> str:
    """How a child process ended, from its `os.waitpid` status."""
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"
