"""Callbacks built from the `callbacks` config section, one job each.

The stability callbacks (loss spike, non-finite guard, gradient-norm and throughput monitors, stability report) come
from their typed sections; a user's own callbacks from `callbacks.extra` as an explicit `module:Class`.
"""

import dataclasses
import importlib
import inspect
import os
import sys
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from lit_pretrain.errors import ConfigError
from lit_pretrain.schema import CallbacksConfig, Config


def build_callbacks(c: Config) -> list[Callback]:
    """Every callback the config asks for: the stability ones (in the order their hooks must run), then the user's."""
    return stability_callbacks(c) + evaluation_callbacks(c) + user_callbacks(c.callbacks)


def evaluation_callbacks(c: Config) -> list[Callback]:
    d = c.callbacks.downstream_eval
    if not d.enabled:
        return []
    from lit_pretrain.callbacks.downstream_eval import DownstreamEval  # imports lm-eval: only when enabled

    return [DownstreamEval(d.tasks, c.trainer.val_every_n_steps, every_n_steps=d.every_n_steps, limit=d.limit,
                           max_tokens=d.max_tokens, include_path=d.include_path, batch_size=d.batch_size,
                           num_fewshot=d.num_fewshot)]


def stability_callbacks(c: Config) -> list[Callback]:
    # Imported here: each pulls in torch and Lightning, which loading a config never needs.
    from lit_pretrain.callbacks.gradient_norm import GradientNormMonitor
    from lit_pretrain.callbacks.loss_spike import LossSpike
    from lit_pretrain.callbacks.nan_guard import NanGuard
    from lit_pretrain.callbacks.stability_report import StabilityReport
    from lit_pretrain.callbacks.throughput import ThroughputMonitor

    cb, out = c.callbacks, []
    # Order matters within a step: the guard drops a non-finite update before the spike detector looks at the step,
    # and both decide before the monitors read what was applied.
    if cb.nan_guard.enabled:
        out.append(NanGuard(cb.nan_guard.max_consecutive, cb.nan_guard.check_gradients))
    if cb.loss_spike.enabled:
        spike = cb.loss_spike
        args = {f.name: getattr(spike, f.name) for f in dataclasses.fields(spike) if f.name != "enabled"}
        out.append(LossSpike(**args))
    if cb.gradient_norm.enabled:
        s = c.schedule
        out.append(GradientNormMonitor(
            clip_norm=c.optim.grad_clip_norm,
            log_every_n_steps=cb.gradient_norm.log_every_n_steps or c.trainer.log_every_n_steps,
            per_layer_every_n_steps=cb.gradient_norm.per_layer_every_n_steps,
            schedule=(s.kind, s.warmup_steps, c.trainer.max_steps, s.decay_fraction)))
    if cb.throughput.enabled:
        out.append(ThroughputMonitor(cb.throughput.log_every_n_steps or c.trainer.log_every_n_steps,
                                     peak_flops_per_s=cb.throughput.peak_flops_per_s))
    if cb.moe.enabled and c.model.moe is not None:
        from lit_pretrain.callbacks.moe_monitor import MoEMonitor

        out.append(MoEMonitor(cb.moe.log_every_n_steps or c.trainer.log_every_n_steps, cb.moe.collapse_share,
                              cb.moe.collapse_window))
    if cb.stability_report.enabled:
        out.append(StabilityReport())
    return out


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
