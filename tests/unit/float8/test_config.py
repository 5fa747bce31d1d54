"""float8's option (`lightning_dpar.float8.config`): recipe names and torchao configs resolved, the recipe a config
is, each refusal's message (no torchao, an unknown recipe, a value of another type, skip patterns without float8, a
device without float8 matmuls), and FSDP's float8 all-gather fitted to the device. In-process."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from lightning_dpar.float8 import config
from lightning_dpar.float8.config import RECIPES, check_float8_device, fitted_to_device, recipe_of, resolve_float8


@pytest.fixture
def ao():
    """torchao's float8 module; the tests that need it skip without it (the refusals of values and of a missing
    torchao run either way)."""
    return pytest.importorskip("torchao.float8")


def emulated(recipe: str) -> object:
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_recipe_name_becomes_torchaos_config_for_it(recipe, ao):
    options = resolve_float8(recipe, None, "FullyShardStrategy")
    assert options.config == ao.Float8LinearConfig.from_recipe_name(recipe)
    assert options.recipe == recipe and options.setting == repr(recipe) and options.skip is None


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_config_is_taken_as_it_is_and_its_recipe_recognised(recipe, ao):
    options = resolve_float8(emulated(recipe), ["model.head"], "FullyShardStrategy")
    assert options.config.emulate and options.recipe == recipe and options.skip == ("model.head",)
    assert options.setting == f"Float8LinearConfig(<{recipe} recipe>, emulate=True)"
    assert recipe_of(dataclasses.replace(emulated(recipe), pad_inner_dim=True)) == recipe


def test_a_config_no_recipe_gives_is_custom(ao):
    custom = dataclasses.replace(emulated("rowwise"), round_scales_to_power_of_2=False)
    assert recipe_of(custom) == "custom"


def test_no_float8_is_none():
    assert resolve_float8(None, None, "S") is None


@pytest.mark.parametrize(
    ("setting", "skip", "error", "expected"),
    [
        ("fp8", None, ValueError, ["`S(float8='fp8')`", "'fp8' is not a float8 recipe", "['tensorwise', 'rowwise'"]),
        (8, None, TypeError, ["got a int", "Float8LinearConfig", "emulate=True"]),
        ("rowwise", "model.head", TypeError, ["float8_skip='model.head'", "must be a list"]),
        (None, ["head"], ValueError, ["float8_skip=['head']", "without `float8=`"]),
    ],
)
def test_refusals_name_the_value_and_the_fix(setting, skip, error, expected):
    if setting in (8, "rowwise"):  # told apart once torchao is imported
        pytest.importorskip("torchao.float8")
    with pytest.raises(error) as raised:
        resolve_float8(setting, skip, "S")
    for part in expected:
        assert part in str(raised.value), (part, str(raised.value))


def test_without_torchao_the_refusal_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ImportError) as raised:
        resolve_float8("rowwise", None, "FullyShardStrategy")
    message = str(raised.value)
    assert "`FullyShardStrategy(float8='rowwise')`" in message
    assert 'pip install "lightning_dpar[float8]"' in message and "drop `float8=`" in message


def test_a_cpu_without_emulation_is_refused_with_the_emulated_config_as_the_fix(ao):
    options = resolve_float8("rowwise", None, "FullyShardStrategy")
    with pytest.raises(RuntimeError) as raised:
        check_float8_device(options, torch.device("cpu"), "FullyShardStrategy")
    message = str(raised.value)
    assert "`FullyShardStrategy(float8='rowwise')` needs float8 matmuls" in message
    assert "the cpu device does not have" in message and "compute capability 8.9" in message
    assert "from_recipe_name('rowwise'), emulate=True)" in message
    check_float8_device(resolve_float8(emulated("rowwise"), None, "S"), torch.device("cpu"), "S")
    check_float8_device(None, torch.device("cpu"), "S")


def test_a_gpu_older_than_8_9_is_refused(monkeypatch, ao):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(RuntimeError, match=r"a GPU of compute capability 8\.0 does not have"):
        check_float8_device(resolve_float8("tensorwise", None, "S"), torch.device("cuda", 0), "S")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_float8_device(resolve_float8("tensorwise", None, "S"), torch.device("cuda", 0), "S")


def test_fsdps_float8_all_gather_falls_back_to_high_precision_off_cuda(ao):
    wanted = dataclasses.replace(emulated("tensorwise"), enable_fsdp_float8_all_gather=True)
    with pytest.warns(UserWarning, match="needs NCCL"):
        fitted = fitted_to_device(wanted, torch.device("cpu"))
    assert not fitted.enable_fsdp_float8_all_gather
    assert dataclasses.replace(fitted, enable_fsdp_float8_all_gather=True) == wanted
    assert fitted_to_device(wanted, torch.device("cuda", 0)) is wanted
    plain = emulated("rowwise")
    assert fitted_to_device(plain, torch.device("cpu")) is plain
    assert config.FLOAT8_DEVICE_CAPABILITY == (8, 9)
