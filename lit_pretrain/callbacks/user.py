"""A user's own callbacks from `callbacks.extra`, as an explicit `module:Class`: found, imported and checked when the
config loads (config.py), built when the run starts (build_callbacks). Apart from the other callbacks, so that the
config can check them without importing what those import (the evaluation harness, checkpoints, the config)."""

import importlib
import inspect
import os
import sys
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from lit_pretrain.errors import ConfigError
from lit_pretrain.schema import CallbacksConfig


def import_user_module(module_name: str, key: str, folders=()):
    """The module of a `module:Class`, looked up on sys.path (PYTHONPATH, installed packages; the working directory
    under `python -m`), then in each of `folders` (config.load passes the run file's folder), then in the working
    directory (which the `lit-pretrain` script does not put on sys.path). A folder that finds it stays on sys.path,
    last (it shadows nothing installed): later imports here and processes spawned from here (multiprocessing passes
    sys.path on) find it; ranks a launcher starts (Lightning's, torchrun, srun) run the command again and load the
    config, and with it the module, themselves."""
    looked = list(dict.fromkeys(str(Path(f)) for f in (*folders, os.getcwd())))
    missing = None
    for folder in [None, *looked]:
        added = folder is not None and folder not in sys.path
        if folder is not None and not added:
            continue  # on sys.path already: the first attempt looked there
        if added:
            sys.path.append(folder)
            importlib.invalidate_caches()
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if not (err.name == module_name or module_name.startswith(f"{err.name}.")):  # not the module itself:
                raise ConfigError(f"{key}: cannot import module '{module_name}' ({err})") from None  # what it imports
            missing = err
        except ImportError as err:
            raise ConfigError(f"{key}: cannot import module '{module_name}' ({err})") from None
        except SyntaxError as err:  # its message names the file and line, which is all a traceback would add
            raise ConfigError(f"{key}: cannot import module '{module_name}': SyntaxError: {err}") from None
        finally:
            if added and module_name not in sys.modules:
                sys.path.remove(folder)
    raise ConfigError(f"{key}: cannot import module '{module_name}' ({missing}); looked on sys.path (PYTHONPATH, "
                      f"installed packages), then in {', '.join(looked)}: put it beside the run file or in the "
                      "working directory, or add its folder to PYTHONPATH")


def user_classes(cfg: CallbacksConfig, folders=()) -> list[tuple[type, dict]]:
    """(class, init_args) of each `callbacks.extra` spec, imported and checked without calling anything: config.load
    runs this, so `show` refuses a class `train` could not build (import_user_module says where modules are found).
    Every way a spec can fail here is one ConfigError line naming `callbacks.extra[i]` and the class path: a module
    that cannot be imported, a missing name, a name that is not a Lightning Callback class, init_args that do not
    fit the signature."""
    out = []
    for i, spec in enumerate(cfg.extra):
        key = f"callbacks.extra[{i}].class_path"
        module_name, _, class_name = spec.class_path.partition(":")
        module = import_user_module(module_name, f"{key}='{spec.class_path}'", folders)
        cls = getattr(module, class_name, None)
        if cls is None:
            raise ConfigError(f"{key}='{spec.class_path}': module {module_name} has no '{class_name}'; "
                              "check the spelling of the class name")
        if not (inspect.isclass(cls) and issubclass(cls, Callback)):
            raise ConfigError(
                f"{key}='{spec.class_path}': '{class_name}' is not a Lightning Callback class in {module_name}"
            )
        args = dict(spec.init_args)
        try:
            # Bind first, so a keyword that does not exist is told apart from a TypeError the constructor raises.
            inspect.signature(cls).bind(**args)
        except TypeError as err:
            raise ConfigError(f"callbacks.extra[{i}].init_args do not fit {spec.class_path}: {err}") from None
        except ValueError:  # no signature to inspect (a C-implemented class): let the call itself decide
            pass
        out.append((cls, args))
    return out


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
