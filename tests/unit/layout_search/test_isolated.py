"""The layout search in a forked child (`lightning_dpar.layout_search.isolated`): it needs no import of the model's
class by name, survives the process group of the process it forks from (which it neither uses nor shuts down),
and hands back results and refusals as they were raised."""

from __future__ import annotations

import gc
import os
import signal
import sys

import pytest
import torch
import torch.distributed as dist

from lightning_dpar.examples.gpt import GPT
from lightning_dpar.layout_search.isolated import run_in_fork, search_anywhere
from lightning_dpar.layout_search.profiles import PRESETS
from lightning_dpar.parallel_dims import init_fake_process_group


def _class_only_in_memory(base: type, **namespace) -> type:
    """A class as a user's script defines it: its module is `__main__`, where pickle could not find it by name."""
    cls = type("ScriptModule", (base,), {"__module__": "__main__", **namespace})
    assert not hasattr(__import__("__main__"), "ScriptModule")
    return cls


def _describe_in_child(obj: object) -> tuple[int, str, int]:
    return os.getpid(), type(obj).__qualname__, obj.value()  # type: ignore[attr-defined]


def test_the_child_runs_on_an_object_whose_class_cannot_be_imported():
    cls = _class_only_in_memory(object, value=lambda self: 42)
    pid, name, value = run_in_fork(_describe_in_child, cls())
    assert pid != os.getpid() and (name, value) == ("ScriptModule", 42)


def _raise(kind: type[BaseException], message: str) -> None:
    raise kind(message)


@pytest.mark.parametrize("kind", [ValueError, TypeError])
def test_a_refusal_reaches_the_caller_with_its_type_and_message(kind):
    with pytest.raises(kind, match=r"^`tensor_parallel_size=3` does not divide 4 ranks\.$"):
        run_in_fork(_raise, kind, "`tensor_parallel_size=3` does not divide 4 ranks.")


def test_any_other_failure_reaches_the_caller_with_the_childs_traceback():
    with pytest.raises(RuntimeError, match=r"(?s)failed:\n.*in _raise.*KeyError: 'boom'"):
        run_in_fork(_raise, KeyError, "boom")


def test_a_child_that_dies_without_answering_is_reported_with_its_exit():
    with pytest.raises(RuntimeError, match=r"ended without an answer \(exit code 7\)"):
        run_in_fork(os._exit, 7)


def test_a_result_that_cannot_be_sent_back_is_the_childs_failure():
    with pytest.raises(RuntimeError, match=r"(?s)failed:.*pickle"):
        run_in_fork(lambda: lambda: None)  # a lambda does not pickle


def _fake_world_size(world_size: int) -> tuple[int, str]:
    init_fake_process_group(0, world_size)
    try:
        return dist.get_world_size(), dist.get_backend()
    finally:
        dist.destroy_process_group()


def test_the_child_forgets_the_parents_process_group_and_the_parent_keeps_it(gloo_world):
    """A `dpar_auto` Trainer after another Trainer, or in a Ray worker: the process group exists before the search."""
    assert run_in_fork(_fake_world_size, 8) == (8, "fake")
    assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
    value = torch.ones(2)
    dist.all_reduce(value)  # the parent's group still works
    assert value.tolist() == [1.0, 1.0]


class _Cycle:
    """An object only a reference cycle keeps: unreachable, it waits for the cyclic collector."""

    def __init__(self, held: object) -> None:
        self.held, self.me = held, self


def _leave_a_finished_groups_garbage() -> None:
    """What a finished Trainer leaves until the next collection: its gloo group, destroyed, held by a cycle."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.all_reduce(torch.ones(1))  # the group's threads run
    _Cycle(dist.group.WORLD)
    dist.destroy_process_group()


def _alarm(signum, frame):
    raise TimeoutError("the child did not answer within 60 s")


def test_the_child_never_collects_the_parents_garbage():
    """Collected in the child, the group's destructor would join threads that exist only here: the child hung."""
    gc.collect()
    gc.disable()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(60)
    try:
        _leave_a_finished_groups_garbage()
        collected_there = run_in_fork(gc.collect)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        gc.enable()
    assert collected_there == 0
    assert gc.collect() > 0  # it was garbage, and this process collects it


def _tiny_gpt() -> type:
    def __init__(self) -> None:
        GPT.__init__(self, vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)

    return _class_only_in_memory(GPT, __init__=__init__)


def test_the_search_of_a_script_defined_model_in_a_child_makes_the_same_choice_here():
    model = _tiny_gpt()()
    args = (2, 1, PRESETS["cpu-gloo"], 1)  # a batch of 1: no pipeline layout to dry-run (its microbatches need more)
    # The same choice. On torch's CUDA builds a child forked after this process ran a backward (an earlier test, an
    # earlier Trainer) cannot run one (autograd's device threads do not survive a fork): its activation trace falls
    # back to the formula and context-parallel layouts are not estimated (a known gap, see CHANGELOG), so the child
    # ranks a subset of the layouts ranked here.
    there, here = search_anywhere(model, *args, in_child=True), search_anywhere(model, *args)
    assert there.best is not None and here.best is not None
    assert there.best.layout == here.best.layout
    assert len({e.layout.dims for e in here.ranked}) > 1  # a choice between meshes, not the only one
    assert {e.layout for e in there.ranked} <= {e.layout for e in here.ranked}


def _registries_left() -> dict[str, int]:
    """The size of every map and list of process-group state torch's `_world` keeps, in the child."""
    from torch.distributed import distributed_c10d

    world = distributed_c10d._world
    sized = {}
    for name in [n for n, v in vars(type(world)).items() if isinstance(v, property)]:
        try:
            value = getattr(world, name)
        except ValueError:  # `pg_config_info` needs a default group: derived from the maps, none of its own
            continue
        if isinstance(value, (dict, list)):
            sized[name] = value
    return {"default_pg": int(world.default_pg is not None), **{name: len(value) for name, value in sized.items()}}


def test_the_child_forgets_every_registry_of_process_groups(gloo_world):
    """A registry a newer torch adds and `forget_inherited_process_groups` misses shows up here."""
    left = run_in_fork(_registries_left)
    assert "pg_map" in left and "pg_names" in left
    assert left == dict.fromkeys(left, 0)


class _BrokenOutput:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        raise BrokenPipeError


def _answer_with_broken_output() -> int:
    sys.stdout = _BrokenOutput()
    return 1


def test_a_child_whose_output_is_broken_still_answers_and_exits():
    assert run_in_fork(_answer_with_broken_output) == 1


def test_the_searchs_own_refusal_reaches_the_caller_from_the_child():
    """A script's model with no sequence length: the search refuses it inside the child, in its own words."""
    import lightning as L
    from torch import nn

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.net = nn.Linear(8, 8)

    mlp = _class_only_in_memory(L.LightningModule, __init__=__init__)()
    with pytest.raises(ValueError, match=r"^The sequence length is unknown: .* Pass `seq_len`"):
        search_anywhere(mlp, 2, 1, PRESETS["cpu-gloo"], 4, in_child=True)
