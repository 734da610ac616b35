"""Callbacks built from the `callbacks` config section, one job each."""

import importlib
import inspect

from lightning.pytorch.callbacks import Callback

from lit_pretrain.errors import ConfigError
from lit_pretrain.schema import CallbacksConfig


def user_callbacks(cfg: CallbacksConfig) -> list[Callback]:
    """Instantiate `callbacks.extra`: the one place a config names code, as an explicit `module:Class`."""
    out = []
    for i, spec in enumerate(cfg.extra):
        key = f"callbacks.extra[{i}].class_path"
        module_name, _, class_name = spec.class_path.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ConfigError(f"{key}='{spec.class_path}': cannot import module '{module_name}' ({err})") from None
        cls = getattr(module, class_name, None)
        if not (inspect.isclass(cls) and issubclass(cls, Callback)):
            raise ConfigError(
                f"{key}='{spec.class_path}': '{class_name}' is not a Lightning Callback class in {module_name}"
            )
        try:
            out.append(cls(**dict(spec.init_args)))
        except TypeError as err:
            raise ConfigError(f"callbacks.extra[{i}].init_args do not fit {spec.class_path}: {err}") from None
    return out
