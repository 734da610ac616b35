"""User callbacks from config: `module:Class` with plain-data init_args, and clear errors for anything else."""

import lightning as L
import pytest

from lit_pretrain.callbacks.user import user_callbacks
from lit_pretrain.errors import ConfigError
from lit_pretrain.schema import CallbacksConfig, CallbackSpec


class CountSteps(L.Callback):
    def __init__(self, every_n_steps: int = 1):
        self.every_n_steps = every_n_steps


class NotACallback:
    pass


def build(class_path, **init_args):
    return user_callbacks(CallbacksConfig(extra=[CallbackSpec(class_path=class_path, init_args=init_args)]))


def test_builds_the_named_callback_with_its_arguments():
    (cb,) = build("tests.callbacks.test_callbacks:CountSteps", every_n_steps=7)
    assert isinstance(cb, CountSteps) and cb.every_n_steps == 7


@pytest.mark.parametrize("class_path, args, message", [
    ("no_such_module_xyz:Thing", {}, r"callbacks\.extra\[0\]\.class_path='no_such_module_xyz:Thing': cannot import"),
    ("tests.callbacks.test_callbacks:NotACallback", {}, "is not a Lightning Callback class"),
    ("tests.callbacks.test_callbacks:Missing", {}, r"module tests\.callbacks\.test_callbacks has no 'Missing'"),
    ("tests.callbacks.test_callbacks:CountSteps", {"every_n_step": 3}, r"callbacks\.extra\[0\]\.init_args do not fit"),
])
def test_bad_specs_name_the_key(class_path, args, message):
    with pytest.raises(ConfigError, match=message):
        build(class_path, **args)
