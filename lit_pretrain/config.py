"""Load an experiment: compose YAML files, apply command-line overrides, check every key, type and range.

An experiment is a run file under `experiments/runs/` whose `defaults:` list names what it builds on:

    defaults:
      - base              # experiments/base.yaml, a full-config fragment
      - model: tiny       # experiments/model/tiny.yaml, the contents of the `model` section
      - strategy: single  # experiments/strategy/single.yaml
    trainer:
      max_steps: 200      # the run file's own keys win over its defaults

Command-line overrides come last: `strategy=ddp` picks another group file (replacing the run file's choice) and
`optim.lr_peak=1e-3` sets one key. Errors name the key, the file (or "command line") and the closest valid key.

Where `defaults` names are found (the search path, first match wins):
  1. the run file's own experiments root: the nearest folder above the run file that holds a `base.yaml`, or else
     the run file's own folder (so `~/work/zl.yaml` may ship its own `~/work/model/mine.yaml`);
  2. the project's shipped `experiments/` folder, next to the `lit_pretrain` package in a source checkout.
So a run file anywhere can write `defaults: [base, {model: tiny}]` and get the shipped base and tiny model, while a
file of the same name in its own root overrides the shipped one. An installed wheel carries no `experiments/`:
there only the run file's root is searched, and a name not found there says so. Errors list every folder searched.

A key that holds a list of strings takes one string as a one-element list, in a file or on the command line:
`data.paths=/corpus` is `data.paths=[/corpus]`.

What a config names outside itself is checked when it loads (`check_inputs`), so `show` refuses what `train` would:
every data.paths entry exists (data/locate.py), and every callbacks.extra `module:Class` imports, is a Lightning
Callback and takes its init_args (user_classes: the module is looked up on sys.path, then in the run
file's folder, then in the working directory).
"""

import copy
import dataclasses
import difflib
import functools
import importlib
import importlib.util
import inspect
import math
import os
import re
import sys
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, List, Optional, Sequence, Tuple

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lit_pretrain.errors import ConfigError
from lit_pretrain.paths import is_safe_name
from lit_pretrain.schema import CallbacksConfig, Config

if TYPE_CHECKING:
    from lit_pretrain.planning.plan import ParallelPlan

GROUPS = ("model", "data", "strategy", "optim", "schedule", "trainer", "callbacks", "run")
COMMAND_LINE = "the command line"


def experiments_root(run_file: Path) -> Path:
    """The `experiments/` folder a run file belongs to (the nearest ancestor holding base.yaml)."""
    for parent in run_file.resolve().parents:
        if (parent / "base.yaml").is_file():
            return parent
    return run_file.resolve().parent


def shipped_experiments() -> Optional[Path]:
    """The project's own `experiments/` folder (a source checkout: beside the package), or None where it is absent
    (an installed wheel packages `lit_pretrain` only)."""
    folder = Path(__file__).resolve().parents[1] / "experiments"
    return folder if (folder / "base.yaml").is_file() else None


def search_path(run_file: Path) -> List[Path]:
    """Folders that `defaults` names are looked up in, first match wins (see the module docstring)."""
    roots = [experiments_root(run_file)]
    shipped = shipped_experiments()
    if shipped is not None and shipped not in roots:
        roots.append(shipped)
    return roots


def _where(roots: Sequence[Path]) -> str:
    looked = ", ".join(str(r) for r in roots)
    if shipped_experiments() is None:
        looked += " (the project's experiments/ folder is not installed with the package: copy the files you need " \
                  "next to your run file)"
    return looked


def _check_name(name: str, what: str, source: str) -> None:
    # A group choice or base name is one file name in a search-path folder, never a path: `strategy=../../x` must
    # not read YAML from outside the search path. The rule is the run name's (paths.SAFE_NAME).
    if not is_safe_name(name):
        raise ConfigError(f"{what}={name!r} in {source}: a config name is one file name of letters, digits, '.', '_' "
                          "and '-' (not a path); give a run file's path as the first argument instead")


def _find(roots: Sequence[Path], relative: str) -> Optional[Path]:
    return next((root / relative for root in roots if (root / relative).is_file()), None)


class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """yaml.SafeLoader that refuses a key given twice in one mapping: PyYAML keeps the last one silently, so a second
    `trainer:` block would drop every setting of the first (the YAML 1.2 spec requires keys to be unique). The
    libyaml parser where PyYAML was built with it (the same documents, parsed in C): a quarter of a load's time
    was the pure-Python parser."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, typing.Hashable) and key in seen:
                raise _DuplicateKey(key, seen[key], key_node.start_mark.line + 1)
            if isinstance(key, typing.Hashable):
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


class _DuplicateKey(Exception):
    def __init__(self, key, first_line: int, line: int):
        super().__init__(key, first_line, line)
        self.key, self.first_line, self.line = key, first_line, line


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    with open(path) as f:
        try:
            # A SafeLoader: a config is data; no YAML tag may construct Python objects.
            data = yaml.load(f, Loader=_UniqueKeyLoader)
        except yaml.YAMLError as err:
            raise ConfigError(f"{path} is not valid YAML: {err}") from None
        except _DuplicateKey as dup:
            raise ConfigError(f"{path}: key '{dup.key}' is given twice in one mapping (lines {dup.first_line} and "
                              f"{dup.line}), and only one would count: merge the two into one") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of config keys, not {type(data).__name__}")
    return data


# Keys that were replaced, and what to write instead (a key that only vanished would read as a typo).
RENAMED = {
    "trainer.val_batches": "set trainer.val_windows, the validation windows in all (the same set for any number of "
                           "processes; val_batches counted batches per device): val_batches × micro_batch_size × "
                           "data-parallel processes gives the windows it validated",
}


# Keys that moved to another section: read into their new place with a one-line notice, so run files, command
# lines and finished runs' config.yaml written before still load. Training settings that sat on the architecture
# config (the GPT ignored them) now sit where the layout and the step's numerics are chosen.
MOVED = {
    "model.activation_checkpointing": "strategy.activation_checkpointing",
    "model.activation_checkpointing_k": "strategy.activation_checkpointing_k",
    "model.activation_checkpointing_save_matmuls": "strategy.activation_checkpointing_save_matmuls",
    "model.float8": "trainer.float8",
}


def move_keys(data: Any, source: str) -> Any:
    """`data` (a mapping of sections) with each MOVED key in its new place, and one line on stderr naming them; an old
    key beside its new one in the same source is refused, since only one would count."""
    if not isinstance(data, dict):
        return data
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    moved = []
    for old, new in MOVED.items():
        (old_section, old_key), (new_section, new_key) = old.split(".", 1), new.split(".", 1)
        if not isinstance(out.get(old_section), dict) or old_key not in out[old_section]:
            continue
        value = out[old_section].pop(old_key)
        target = out.setdefault(new_section, {})
        if target is None:
            target = out[new_section] = {}
        if not isinstance(target, dict):
            raise ConfigError(f"config key '{new_section}' in {source} is a section: give a mapping of its keys")
        if new_key in target:
            raise ConfigError(f"config keys '{old}' and '{new}' are both given in {source}, and only one would count: "
                              f"{old} is now {new}; keep that one")
        target[new_key] = value
        moved.append(old)
    moved_notice(source, moved)
    return out


def moved_notice(source: str, old_keys: Sequence[str]) -> None:
    """One line on stderr naming the MOVED keys `source` holds and where they are read now."""
    if old_keys:
        pairs = ", ".join(f"{old} -> {MOVED[old]}" for old in old_keys)
        print(f"notice: {source} uses moved config keys, read in their new place: {pairs} (rename them there)",
              file=sys.stderr, flush=True)


def _check_keys(data: Any, schema: Any, prefix: str, source: str) -> None:
    """Every key must exist in the schema; say which one is wrong, where it came from and what was meant."""
    if not dataclasses.is_dataclass(schema) or not isinstance(data, dict):
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if full in RENAMED:
            raise ConfigError(f"config key '{full}' in {source} was replaced: {RENAMED[full]}")
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; valid keys here: {', '.join(fields)}"
            raise ConfigError(f"unknown config key '{full}' in {source}{hint}")
        default = getattr(schema, key) if not isinstance(schema, type) else None
        sub = fields[key].type
        target = default if dataclasses.is_dataclass(default) else sub if dataclasses.is_dataclass(sub) else None
        if target is not None:
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"config key '{full}' in {source} is a section: give a mapping of its keys")
            _check_keys(value, target, f"{full}.", source)


@functools.cache
def _hints(schema: type) -> dict:
    return typing.get_type_hints(schema)  # resolves every annotation of the class: cached, a load asks ~25 times


def _one_as_list(data: Any, schema: Any) -> Any:
    """`data` with each list-of-strings key given one string (`paths: /corpus`, `data.paths=/corpus`) holding it as a
    one-element list, in sections and in list items that are sections (data.sources[i].paths). OmegaConf would
    refuse the string ("AnyNode is not a ListConfig")."""
    if not isinstance(data, dict):
        return data
    hints = _hints(schema if isinstance(schema, type) else type(schema))
    out = {}
    for key, value in data.items():
        kind = hints.get(key)
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if typing.get_origin(kind) is typing.Union and len(args) == 1:  # Optional[X] is Union[X, None]
            kind = args[0]
        if typing.get_origin(kind) is list:
            (item,) = typing.get_args(kind)
            if item is str and isinstance(value, str):
                value = [value]
            elif dataclasses.is_dataclass(item) and isinstance(value, list):
                value = [_one_as_list(v, item) for v in value]
        elif dataclasses.is_dataclass(kind) and isinstance(value, dict):
            value = _one_as_list(value, kind)
        out[key] = value
    return out


def _merge(base: DictConfig, data: dict, source: str) -> DictConfig:
    """`data` merged into `base` in place (OmegaConf.merge would deep-copy the whole config for each source: most
    of a load's time); on an error `base` is left half-merged, and load() discards it."""
    data = move_keys(data, source)
    _check_keys(data, Config(), "", source)
    data = _one_as_list(data, Config)
    try:
        base.merge_with(data)
        return base
    except OmegaConfBaseException as err:
        raise ConfigError(f"config key '{err.full_key}' in {source}: {_first_line(err)}") from None


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0]


def _parse_overrides(overrides: Sequence[str]) -> Tuple[dict, List[str]]:
    """Split `group=name` choices from `a.b=value` key overrides."""
    groups, keys = {}, []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                f"override '{item}' on the command line must look like key=value (e.g. trainer.max_steps=200)"
            )
        key, value = item.split("=", 1)
        if "." not in key and key in GROUPS and value and not value.startswith(("{", "[")):
            groups[key] = value
        else:
            keys.append(item)
    return groups, keys


def _defaults(data: dict, path: Path) -> List[Tuple[Optional[str], str]]:
    entries = data.pop("defaults", []) or []
    if not isinstance(entries, list):
        raise ConfigError(f"'defaults' in {path} must be a list like [base, {{model: tiny}}]")
    parsed = []
    for entry in entries:
        if isinstance(entry, str):
            parsed.append((None, entry))
        elif isinstance(entry, dict) and len(entry) == 1:
            (group, name), = entry.items()
            if group not in GROUPS:
                close = difflib.get_close_matches(str(group), GROUPS, n=1)
                hint = f"; did you mean {close[0]}?" if close else f"; groups are {', '.join(GROUPS)}"
                raise ConfigError(f"unknown config group '{group}' in the defaults of {path}{hint}")
            parsed.append((group, str(name)))
        else:
            raise ConfigError(f"entry {entry!r} in the defaults of {path} must be a file name or {{group: name}}")
    return parsed


def _group_file(roots: Sequence[Path], group: str, name: str, source: str) -> Path:
    _check_name(name, group, source)
    path = _find(roots, f"{group}/{name}.yaml")
    if path is None:
        options = sorted({p.stem for root in roots for p in (root / group).glob("*.yaml")})
        raise ConfigError(f"{group}={name} in {source}: no file {group}/{name}.yaml in {_where(roots)}; "
                          f"choose one of: {', '.join(options) or 'none'}")
    return path


def _base_file(roots: Sequence[Path], name: str, source: Path) -> Path:
    _check_name(name, "defaults entry", str(source))
    path = _find(roots, f"{name}.yaml")
    if path is None:
        raise ConfigError(f"'{name}' in the defaults of {source}: no file {name}.yaml in {_where(roots)}")
    return path


@functools.lru_cache(maxsize=1)
def _schema_config() -> DictConfig:
    return OmegaConf.structured(Config)


class Loaded(Config):
    """What `load` returns: the typed config (schema.Config, every key, range and cross-key rule checked) and `plan`,
    the parallel plan it resolves to (planning/plan.py), built once at load and handed to `train`, the Lightning
    strategy, the module and the memory planner. `plan` is not a config key: `save` writes the schema's fields."""

    plan: "ParallelPlan"

    @classmethod
    def of(cls, config: Config, plan: "ParallelPlan") -> "Loaded":
        loaded = cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(Config)})
        object.__setattr__(loaded, "plan", plan)  # not a field: Section's guard would refuse it
        return loaded


def load(run_file: Optional[str | Path] = None, overrides: Iterable[str] = (), check_memory: bool = True,
         check_inputs: bool = True) -> Loaded:
    """Compose the run file with its defaults and the overrides into a checked config and its plan (`Loaded`).
    Every check `train` makes before its first step runs here (`check`), so `show` refuses what `train` refuses.
    check_memory=False: leave trainer.device_memory_gb unchecked (`lit-pretrain memory --run` shows why it fails).
    check_inputs=False: leave data.paths and callbacks.extra unchecked, for a finished run's config.yaml read for its
    model and tokenizer (generate, export, evaluate), whose corpus may have moved since."""
    cfg = copy.deepcopy(_schema_config())  # a copy of one built schema: building it is ~20 ms, copying ~3
    groups, key_overrides = _parse_overrides(list(overrides))
    steps_given = [COMMAND_LINE for o in key_overrides if o.split("=", 1)[0].strip() == "trainer.max_steps"]
    if run_file is not None:
        run_path = Path(run_file)
        roots = search_path(run_path)
        data = _read_yaml(run_path)
        chosen = dict(groups)
        for group, name in _defaults(data, run_path):
            if group is None:
                path = _base_file(roots, name, run_path)
                cfg = _merge(cfg, _defaults_free(path), str(path))
                continue
            source = COMMAND_LINE if group in chosen else str(run_path)
            path = _group_file(roots, group, chosen.pop(group, name), source)
            cfg = _merge(cfg, {group: _read_yaml(path)}, str(path))
        for group, name in chosen.items():
            path = _group_file(roots, group, name, COMMAND_LINE)
            cfg = _merge(cfg, {group: _read_yaml(path)}, str(path))
        cfg = _merge(cfg, data, str(run_path))
        if "max_steps" in (data.get("trainer") or {}):
            steps_given.append(str(run_path))
    elif groups:
        raise ConfigError(f"group choices {groups} on the command line need a run file to find experiments/")
    if key_overrides:
        try:
            dot = OmegaConf.from_dotlist(key_overrides)
        except (OmegaConfBaseException, yaml.YAMLError) as err:
            # OmegaConf parses each value as YAML: `run.name=...` raises yaml's ParserError, not its own error.
            raise ConfigError(f"cannot parse overrides on the command line ({', '.join(key_overrides)}): "
                              f"{_first_line(err)}; quote a value that YAML reads as syntax") from None
        cfg = _merge(cfg, OmegaConf.to_container(dot), COMMAND_LINE)
    check_values(cfg)  # before the sections are built: a section's own __post_init__ would refuse with less
    config = OmegaConf.to_object(cfg)  # the one conversion: from here on the typed dataclass
    _token_budget(config, steps_given)
    plan = check(config)
    if check_memory:
        from lit_pretrain.planning.run_plan import check_fits

        check_fits(config, plan)
    if check_inputs:
        check_inputs_exist(config, None if run_file is None else Path(run_file))
    return Loaded.of(config, plan)


def loaded(cfg: "Config | DictConfig") -> Loaded:
    """`cfg` as `load` returns it: a Loaded as it is; a DictConfig or a bare Config (an older caller's) converted,
    checked (`check`, `check_fits`, `check_inputs_exist`) and given its plan, as `load` would."""
    if isinstance(cfg, Loaded):
        return cfg
    check_values(cfg)  # before to_object builds the sections, as in load
    config = to_object(cfg)
    plan = check(config)
    from lit_pretrain.planning.run_plan import check_fits

    check_fits(config, plan)
    check_inputs_exist(config, None)
    return Loaded.of(config, plan)


def check_inputs_exist(config: Config, run_file: Optional[Path]) -> None:
    """What the config names outside itself, as `prepare` and `train` will look for it: every data.paths entry
    (relative to the working directory), and each callbacks.extra module, imported now (sys.path, then the run
    file's folder, then the working directory: import_user_module)."""
    from lit_pretrain.data.locate import check_paths_exist

    check_paths_exist(config.data)
    if config.callbacks.extra:
        folders = [run_file.resolve().parent] if run_file is not None else []
        user_classes(config.callbacks, folders)


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
    from lightning.pytorch.callbacks import Callback  # imports Lightning: only when a user callback is named

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


def _token_budget(cfg: Config, steps_given: List[str]) -> None:
    """trainer.tokens_per_param: max_steps from the tokens-per-parameter ratio (scaling/run_plan.budget_steps)."""
    if cfg.trainer.tokens_per_param is None:
        return
    from lit_pretrain.planning.run_plan import budget_steps

    steps = budget_steps(cfg)
    if steps_given and cfg.trainer.max_steps != steps:
        raise ConfigError(f"trainer.max_steps={cfg.trainer.max_steps} in {steps_given[-1]} and "
                          f"trainer.tokens_per_param={cfg.trainer.tokens_per_param:g} (= {steps} steps) both set the "
                          "run's length: drop one (trainer.tokens_per_param=null to give steps)")
    cfg.trainer.max_steps = steps


def _defaults_free(path: Path) -> dict:
    data = _read_yaml(path)
    if "defaults" in data:
        raise ConfigError(f"{path} has its own 'defaults': only run files compose others")
    return data


def check_finite(data: Any, key: str = "") -> None:
    """Every float in the config, in sections, lists and mappings alike, is a finite number: YAML reads `.inf`,
    `inf` and `nan` as floats, and a range check lets inf through (inf > 0), so optim.lr_peak=inf would load and
    make every weight NaN at the first update."""
    if isinstance(data, float) and not math.isfinite(data):
        raise ConfigError(f"config key '{key}' = {data}: expected a finite number (inf and nan are refused)")
    if isinstance(data, dict):
        for name, value in data.items():
            check_finite(value, f"{key}.{name}" if key else str(name))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            check_finite(value, f"{key}[{i}]")


def check(config: Config) -> "ParallelPlan":
    """Every check `train` makes before its first step, on the config alone, after `check_values`; returns the plan
    it resolves to. `show` and `train` both load through it, so they refuse the same configs with the same message.

    Checks left to `train`, because they need what only exists then: the prepared tokenizer's vocabulary against
    model.vocab_size and the tensor-parallel degree (train.resolve_vocab, parallel/plan.check_vocab), the data
    against the batch (the mixture's windows per step, data/datamodule.check_mixture), the checkpoint a resume
    continues (run.resume: found, verified, its run metadata against this config, resume/session.check), the run
    folder (a name taken by another run), the launcher's world against trainer.devices x trainer.num_nodes
    (parallel/world.check_launcher_world: the processes that exist), lm-eval's task index for the names in
    callbacks.downstream_eval.tasks, and what a callbacks.extra class's own constructor raises."""
    _check_rules(config)
    from lit_pretrain.planning.plan import build_plan

    plan = build_plan(config)
    _check_mtp(config, plan)
    _check_batch_schedule(config, plan)
    _check_checkpoint(config, plan)
    _check_callbacks(config)
    check_loggers(config.trainer.loggers)
    _check_allowed_changes(config)
    return plan


def _check_mtp(config: Config, plan) -> None:
    """model.mtp_depth's modules run inside the GPT's forward on the one loss path (parallel/batch_losses.py), or in
    the pipeline's last stage's loss: the compiled step, which runs elsewhere, and sequence parallelism, which
    would split the modules' positions without their collectives, are refused."""
    if not config.model.mtp_depth:
        return
    depth = config.model.mtp_depth
    if plan.sequence_parallel:
        raise ConfigError(f"model.mtp_depth={depth} with strategy.sequence_parallel=true: the multi-token prediction "
                          "modules run on whole sequences; set strategy.sequence_parallel=false or model.mtp_depth=0")
    if plan.compile:
        raise ConfigError(f"model.mtp_depth={depth} with trainer.compile=true: the compiled step computes the "
                          "next-token loss only; set trainer.compile=false or model.mtp_depth=0")


def _check_batch_schedule(config: Config, plan) -> None:
    """trainer.batch_schedule: each entry splits over the layout at the run's one accumulation
    (planning/batch_schedule.py); refused beside what needs one batch size throughout."""
    if not config.trainer.batch_schedule:
        return
    if config.data.sources:
        raise ConfigError("trainer.batch_schedule with data.sources: a mixture's interleave is laid out for one "
                          "batch per step (data/mixture.py); train a mixture at a fixed trainer.tokens_per_step, or "
                          "set trainer.batch_schedule=[]")
    if plan.pipeline_parallel > 1:
        raise ConfigError(f"trainer.batch_schedule with strategy.pipeline_parallel={plan.pipeline_parallel}: the "
                          "pipeline schedule splits one micro-batch size into its micro-batches; set "
                          "strategy.pipeline_parallel=1 or trainer.batch_schedule=[]")
    from lit_pretrain.planning import batch_schedule
    from lit_pretrain.planning.batch import global_batch

    batch = global_batch(config.trainer, config.model.seq_len, plan)
    batch_schedule.check(config.trainer.batch_schedule, config.model.seq_len, plan.data_parallel, batch.accumulation)


def _check_callbacks(config: Config) -> None:
    """What the callbacks' constructors refuse (callbacks/loss_spike.py, callbacks/downstream_eval.py) beyond
    the schema's ranges."""
    spike = config.callbacks.loss_spike
    if spike.enabled and spike.threshold_sigmas is None and spike.threshold_ratio is None:
        raise ConfigError("callbacks.loss_spike: set threshold_sigmas, threshold_ratio or both (a spike must pass "
                          "every one set)")
    ema = config.callbacks.ema
    if ema.enabled and ema.start_step >= config.trainer.max_steps:
        raise ConfigError(f"callbacks.ema.start_step={ema.start_step} is not below trainer.max_steps="
                          f"{config.trainer.max_steps}: the average would never start; lower start_step")
    d = config.callbacks.downstream_eval
    if not d.enabled:
        return
    if importlib.util.find_spec("lm_eval") is None:  # evaluation/command.require_lm_eval's line
        raise ConfigError("callbacks.downstream_eval.enabled=true needs lm-evaluation-harness, which is not installed: "
                          "pip install 'lit-pretrain[eval]' (or pip install lm-eval)")
    if d.every_n_steps is not None and d.every_n_steps % config.trainer.val_every_n_steps:
        raise ConfigError(
            f"callbacks.downstream_eval.every_n_steps={d.every_n_steps} is not a multiple of trainer.val_every_n_steps="
            f"{config.trainer.val_every_n_steps}: the tasks run at validation time; use a multiple of it, or null for "
            "every validation")
    if not d.tasks:
        raise ConfigError("callbacks.downstream_eval.tasks is empty: name at least one lm-eval task")


def check_loggers(names: Sequence[str]) -> None:
    """trainer.loggers: the optional ones installed (train.loggers builds them)."""
    if "wandb" in names and importlib.util.find_spec("wandb") is None:
        raise ConfigError("trainer.loggers lists wandb, which is not installed: pip install "
                          "'lit-pretrain[logging]', or drop wandb from trainer.loggers")


def _keys(tree: Any, prefix: str = "") -> List[str]:
    """The dotted key of every value in a config's plain data (resume/compat.flatten's keys)."""
    if not isinstance(tree, dict):
        return [prefix[:-1]]
    return [key for k, v in tree.items() for key in _keys(v, f"{prefix}{k}.")]


def _check_allowed_changes(config: Config) -> None:
    """run.resume_allow_changes names config keys (a section names all of its keys), as a resume checks them
    (resume/compat.check_resume)."""
    if not config.run.resume_allow_changes:
        return
    now = _keys(dataclasses.asdict(config))
    unknown = sorted(k for k in config.run.resume_allow_changes
                     if k not in now and not any(n.startswith(k + ".") for n in now))
    if unknown:
        raise ConfigError(f"run.resume_allow_changes names {unknown[0]!r}, which is not a config key")


def _check_checkpoint(config: Config, plan: "ParallelPlan") -> None:
    c = config.checkpoint
    fmt = c.format or ("sharded" if plan.world_size > 1 else "single")
    if c.async_save and fmt != "sharded":
        default = " (the default for one process)" if c.format is None else ""
        raise ConfigError(f"checkpoint.async_save=true writes sharded checkpoints in the background, but "
                          f"checkpoint.format is {fmt}{default}: set checkpoint.format=sharded, or "
                          "checkpoint.async_save=false")


def check_values(cfg: "Config | DictConfig") -> None:
    """Every value finite and within its field's `ge/gt/le/lt/choices/pattern` metadata."""
    check_finite(dataclasses.asdict(cfg) if isinstance(cfg, Config) else OmegaConf.to_container(cfg, resolve=True))
    _check_section(cfg, Config, "")


def check_ranges(cfg: "Config | DictConfig") -> None:
    """Enforce the `ge/gt/le/lt/choices` metadata of every schema field, and cross-field rules (the parallel plan's
    own checks are `check`'s)."""
    check_values(cfg)
    _check_rules(to_object(cfg))


def _check_rules(config: Config) -> None:
    """The rules between keys, and each section's own (`check` methods)."""
    try:
        config.model.check()
    except ValueError as err:
        raise ConfigError(str(err)) from None
    config.optim.check()
    if config.model.moe is not None and config.optim.name == "muon":
        # torch.optim.Muon orthogonalizes 2-D matrices; the experts' stacked (E, out, in) weights are 3-D.
        raise ConfigError("optim.name=muon with model.moe is not supported (Muon orthogonalizes 2-D matrices and the "
                          "experts' weights are stacked 3-D): set optim.name=adamw or model.moe=null")
    if config.schedule.warmup_steps > config.trainer.max_steps:
        raise ConfigError(
            f"schedule.warmup_steps={config.schedule.warmup_steps} exceeds "
            f"trainer.max_steps={config.trainer.max_steps}: lower the warmup or train longer"
        )
    if config.schedule.lr_min > config.optim.lr_peak:
        raise ConfigError(f"schedule.lr_min={config.schedule.lr_min} exceeds optim.lr_peak={config.optim.lr_peak}")
    if config.schedule.stage is not None and config.run.resume is None:
        raise ConfigError("schedule.stage declares a stage's schedule, from the rate of the checkpoint it resumes, but "
                          "run.resume is null: set run.resume to the previous stage's checkpoint, or drop "
                          "schedule.stage (docs/resume.md, \"Stages\")")
    from lit_pretrain.data.locate import check_corpus_reads_paths

    check_corpus_reads_paths(config.data)
    check_stage(config)
    for i, spec in enumerate(config.callbacks.extra):
        module, _, cls = spec.class_path.partition(":")
        if not module or not cls:
            raise ConfigError(
                f"callbacks.extra[{i}].class_path='{spec.class_path}' must be 'module:Class' "
                "(e.g. my_pkg.callbacks:MyCallback)"
            )


def check_stage(config: Config) -> None:
    """data.shuffle_block_tokens, and a context-extension stage (model.seq_len in run.resume_allow_changes): what
    the data order can continue exactly (docs/resume.md)."""
    block, seq_len, data = config.data.shuffle_block_tokens, config.model.seq_len, config.data
    if block is not None and block % seq_len:
        raise ConfigError(f"data.shuffle_block_tokens={block} is not a multiple of model.seq_len={seq_len}: a block "
                          "holds whole windows; set it to a multiple (e.g. the longest context the run will reach)")
    if block is not None and data.sources:
        raise ConfigError("data.shuffle_block_tokens with data.sources is not supported (a mixture draws windows "
                          "from each source): unset data.shuffle_block_tokens")
    if "model.seq_len" in config.run.resume_allow_changes:
        if data.sources:
            raise ConfigError("run.resume_allow_changes lists model.seq_len with data.sources: a mixture's position "
                              "is in windows drawn from each source and cannot be remapped to another window length; "
                              "extend the context on a single corpus")
        if block is None:
            raise ConfigError("run.resume_allow_changes lists model.seq_len (a context-extension stage) but "
                              "data.shuffle_block_tokens is null: the data continues at the next unseen token only "
                              "over blocks both stages share; set data.shuffle_block_tokens to the first stage's (a "
                              "multiple of both seq_lens), which that stage must have trained with")


def _check_section(node: Any, schema: type, prefix: str) -> None:
    for f in dataclasses.fields(schema):
        value = getattr(node, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(f.type) or dataclasses.is_dataclass(value) or isinstance(value, DictConfig):
            # Optional[Section] (model.moe, model.rope_scaling): the section's own class, from the annotation.
            inner = [t for t in typing.get_args(f.type) if dataclasses.is_dataclass(t)]
            sub = f.type if dataclasses.is_dataclass(f.type) else inner[0] if inner else type(getattr(schema(), f.name))
            if dataclasses.is_dataclass(sub):
                _check_section(value, sub, f"{key}.")
            continue
        meta = f.metadata
        if value is None:
            continue
        if "choices" in meta and value not in meta["choices"]:
            raise ConfigError(f"config key '{key}' = {value!r}: expected one of {meta['choices']}")
        if "pattern" in meta and not (isinstance(value, str) and re.fullmatch(meta["pattern"], value)):
            raise ConfigError(f"config key '{key}' = {value!r}: expected {meta['rule']}")
        for op, ok, word in (("ge", lambda a, b: a >= b, ">="), ("gt", lambda a, b: a > b, ">"),
                             ("le", lambda a, b: a <= b, "<="), ("lt", lambda a, b: a < b, "<")):
            if op in meta and not ok(value, meta[op]):
                raise ConfigError(f"config key '{key}' = {value!r}: expected a value {word} {meta[op]}")


def to_object(cfg: "Config | DictConfig") -> Config:
    """The typed dataclass of a config: what `load` returns is one already (returned as it is); a DictConfig (an
    older caller's) is converted."""
    return cfg if isinstance(cfg, Config) else OmegaConf.to_object(cfg)


def to_yaml(cfg: "Config | DictConfig") -> str:
    """The config as YAML, the schema's keys only (a Loaded's plan is not one). A dataclass is dumped as plain data
    (its values are resolved already), as OmegaConf.to_yaml writes it: building an OmegaConf node of it first was
    most of `show`'s time."""
    if not isinstance(cfg, Config):
        return OmegaConf.to_yaml(cfg, resolve=True)
    plain = {f.name: dataclasses.asdict(getattr(cfg, f.name)) for f in dataclasses.fields(Config)}
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml's emitter: the same text, 25x faster
    return yaml.dump(plain, Dumper=dumper, default_flow_style=False, allow_unicode=True, sort_keys=False)


def save(cfg: "Config | DictConfig", path: Path) -> None:
    """Write the fully resolved config, so a run folder records exactly what ran."""
    path.write_text(to_yaml(cfg))
