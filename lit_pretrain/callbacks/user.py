"""A user's own callbacks from `callbacks.extra`, as an explicit `module:Class`, built when the run starts
(user_callbacks) from the classes the config found, imported and checked when it loaded (config.py: user_classes,
import_user_module)."""

from lightning.pytorch.callbacks import Callback

from lit_pretrain.config import user_classes
from lit_pretrain.errors import ConfigError
from lit_pretrain.schema import CallbacksConfig


def user_callbacks(cfg: CallbacksConfig) -> list[Callback]:
    """Instantiate `callbacks.extra`: the one place a config names code, as an explicit `module:Class`.

    Every way a spec can fail becomes one ConfigError line naming `callbacks.extra[i]` and the class path: those of
    `user_classes`, and any exception the constructor raises (the README asks callbacks to check their
    arguments in `__init__` and raise, so that is a bad setting, not a crash). Of the exceptions raised while
    *importing* the module only ImportError and SyntaxError become one line: any other means the module's own code
    failed as it ran, a bug in it whose traceback is the useful report.
    """
    out = []
    for i, (spec, (cls, args)) in enumerate(zip(cfg.extra, user_classes(cfg))):
        try:
            out.append(cls(**args))
        except Exception as err:  # noqa: BLE001 - user code; each failure is reported as a bad setting (see above)
            message = " ".join(str(err).split()) or "(no message)"  # one line, whatever the exception held
            raise ConfigError(
                f"callbacks.extra[{i}] ({spec.class_path}): {type(err).__name__}: {message}"
            ) from None
    return out
