"""Config: every shipped YAML composes and passes its checks; bad keys, types and ranges are clear errors."""

import dataclasses
import re
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from lit_pretrain import config
from lit_pretrain.errors import ConfigError
from lit_pretrain.planning.plan import ParallelPlan
from lit_pretrain.schema import Config

ROOT = Path(__file__).resolve().parents[1] / "experiments"
RUN_FILES = sorted((ROOT / "runs").glob("*.yaml"))
# experiments/ablations/*.yaml are `make ablate` files (lit_pretrain/scaling/ablate.py) and experiments/ladder/*.yaml
# `make ladder` grids (lit_pretrain/scaling/ladder/run.py, tested in tests/scaling/test_ladder.py), not config groups.
GROUP_FILES = sorted(p for p in ROOT.glob("*/*.yaml") if p.parent.name not in ("runs", "ablations", "ladder"))


def test_there_are_shipped_experiments():
    assert {"default.yaml", "tiny.yaml"} <= {p.name for p in RUN_FILES}
    assert len(GROUP_FILES) >= 5


@pytest.mark.parametrize("run_file", RUN_FILES, ids=lambda p: p.stem)
def test_every_run_file_loads(run_file):
    cfg = config.load(run_file)
    assert isinstance(cfg, Config) and isinstance(cfg.plan, ParallelPlan)  # the typed config and its plan
    assert cfg.run.name == run_file.stem  # run names match their files, so runs/<name> is easy to find


@pytest.mark.parametrize("group_file", GROUP_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_group_file_loads_into_a_run(group_file):
    group, name = group_file.parent.name, group_file.stem
    # A preset with tensor or pipeline degrees needs as many processes: the plan is checked when the config loads.
    data = OmegaConf.load(group_file)
    devices = data.get("tensor_parallel", 1) * data.get("pipeline_parallel", 1) if group == "strategy" else 1
    # tiny.yaml's 512 tokens a step are 8 of its model's 64-token windows: a model of another seq_len takes one
    # micro-batch a step (null) rather than a count of tokens its windows may not divide.
    batch = ["trainer.tokens_per_step=null"] if group == "model" else []
    overrides = [f"{group}={name}", f"trainer.devices={devices}", *batch]
    # The pretokenized presets name where their files would lie (data/megatron/train, ...): not here, so the load
    # refuses them by name unless told not to look.
    missing = [p for p in data.get("paths", []) if not Path(p).exists()] if group == "data" else []
    if missing:
        with pytest.raises(ConfigError, match=rf"^data\.paths entry '{missing[0]}' does not exist"):
            config.load(ROOT / "runs" / "tiny.yaml", overrides)
    cfg = config.load(ROOT / "runs" / "tiny.yaml", overrides, check_inputs=not missing)
    run_own = OmegaConf.load(ROOT / "runs" / "tiny.yaml").get(group, {})
    for key, value in OmegaConf.load(group_file).items():
        if key not in run_own:  # the run file's own keys win over its group files
            # A section (model.rope_scaling) holds its other fields at their defaults: the file's keys must be there.
            given = value.items() if isinstance(value, DictConfig) else [(None, value)]
            for sub, v in given:
                loaded = dataclasses.asdict(cfg)[group][key]
                assert (loaded if sub is None else loaded[sub]) == v, f"{group_file}: {key}"


def test_composition_order_run_file_wins_then_command_line():
    cfg = config.load(ROOT / "runs" / "tiny.yaml")
    assert cfg.model.d_model == 64  # from model/tiny.yaml
    assert cfg.optim.lr_peak == 1e-3  # from base.yaml
    assert cfg.trainer.max_steps == 100  # the run file's own key
    cfg = config.load(ROOT / "runs" / "tiny.yaml", ["trainer.max_steps=70", "optim.lr_peak=3e-3"])
    assert (cfg.trainer.max_steps, cfg.optim.lr_peak) == (70, 3e-3)


def test_group_choice_on_the_command_line():
    cfg = config.load(ROOT / "runs" / "tiny.yaml", ["strategy=ddp", "trainer.devices=2"])
    assert cfg.strategy.name == "ddp" and cfg.trainer.devices == 2


def test_struct_mode_rejects_new_keys_after_load():
    cfg = config.load(ROOT / "runs" / "tiny.yaml")
    with pytest.raises(AttributeError, match="TrainerConfig has no config key 'max_step'"):
        cfg.trainer.max_step = 3


def test_unknown_key_on_command_line_names_key_source_and_closest():
    expected = r"unknown config key 'optim\.lr_pek' in the command line; did you mean optim\.lr_peak\?"
    with pytest.raises(ConfigError, match=expected):
        config.load(ROOT / "runs" / "tiny.yaml", ["optim.lr_pek=1e-3"])


def test_a_replaced_key_names_its_replacement():
    """trainer.val_batches (batches per device) became trainer.val_windows (windows in all)."""
    with pytest.raises(ConfigError, match=r"config key 'trainer\.val_batches' in the command line was replaced: set "
                                          r"trainer\.val_windows, the validation windows in all"):
        config.load(ROOT / "runs" / "tiny.yaml", ["trainer.val_batches=4"])


def test_unknown_key_in_a_file_names_that_file(tmp_path):
    run = tmp_path / "experiments" / "runs" / "bad.yaml"
    run.parent.mkdir(parents=True)
    (tmp_path / "experiments" / "base.yaml").write_text("trainer:\n  max_steps: 5\n")
    (tmp_path / "experiments" / "model").mkdir()
    (tmp_path / "experiments" / "model" / "m.yaml").write_text("n_layer: 2\n")
    run.write_text("defaults:\n  - base\n  - model: m\n")
    with pytest.raises(ConfigError) as err:
        config.load(run)
    message = str(err.value)
    assert "'model.n_layer'" in message and str(tmp_path / "experiments" / "model" / "m.yaml") in message
    assert "did you mean model.n_layers?" in message


def test_unknown_section_names_closest():
    with pytest.raises(ConfigError, match="did you mean trainer"):
        config.load(None, ["trainr.max_steps=3"])


def test_wrong_type_names_key_and_expected_type():
    with pytest.raises(ConfigError, match=r"'trainer\.max_steps'.*could not be converted to Integer"):
        config.load(ROOT / "runs" / "tiny.yaml", ["trainer.max_steps=many"])


@pytest.mark.parametrize("override, expected", [
    ("trainer.max_steps=0", r"'trainer\.max_steps' = 0: expected a value >= 1"),
    ("data.val_fraction=1.5", r"'data\.val_fraction' = 1\.5: expected a value < 1\.0"),
    ("schedule.kind=exponential", r"'schedule\.kind' = 'exponential': expected one of"),
    ("model.n_heads=5", r"model\.d_model=64 is not divisible by model\.n_heads=5"),
    ("schedule.warmup_steps=1000", r"schedule\.warmup_steps=1000 exceeds trainer\.max_steps=100"),
    ("callbacks.extra=[{class_path: nocolon}]", r"callbacks\.extra\[0\]\.class_path='nocolon' must be 'module:Class'"),
])
def test_out_of_range_values_name_key_and_expectation(override, expected):
    with pytest.raises(ConfigError, match=expected):
        config.load(ROOT / "runs" / "tiny.yaml", [override])


def test_missing_group_file_lists_choices():
    with pytest.raises(ConfigError, match=r"strategy=hsdp .*choose one of: ddp, fsdp, pipeline, single, tensor, zero"):
        config.load(ROOT / "runs" / "tiny.yaml", ["strategy=hsdp"])


def test_yaml_is_data_not_code(tmp_path):
    bad = tmp_path / "evil.yaml"
    bad.write_text("run: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        config.load(bad)


@pytest.mark.parametrize("override, key", [
    ("optim.lr_peak=inf", "optim.lr_peak"),  # a range check (> 0) lets inf through: its first update made NaN weights
    ("optim.lr_peak=nan", "optim.lr_peak"),
    ("callbacks.loss_spike.threshold_ratio=.inf", "callbacks.loss_spike.threshold_ratio"),  # no range of its own
    ("optim.weight_decay=-.inf", "optim.weight_decay"),
    ("optim.lr_multipliers={embedding: .nan}", "optim.lr_multipliers.embedding"),  # inside a mapping
])
def test_non_finite_floats_are_refused_for_every_key(override, key):
    with pytest.raises(ConfigError, match=rf"config key '{key}' = -?(inf|nan): expected a finite number"):
        config.load(ROOT / "runs" / "tiny.yaml", [override])


def test_a_key_given_twice_in_a_file_is_refused_naming_file_key_and_lines(tmp_path):
    """YAML loaders keep the last of two equal keys: a second `trainer:` block would drop the first's settings."""
    run = tmp_path / "twice.yaml"
    run.write_text("defaults: [base, {model: tiny}, {data: stdlib}, {strategy: single}]\n"
                   "trainer:\n  max_steps: 7\n  micro_batch_size: 2\nrun:\n  name: twice\n"
                   "trainer:\n  log_every_n_steps: 1\n")
    twice = rf"{re.escape(str(run))}: key 'trainer' is given twice in one mapping \(lines 2 and 7\)"
    with pytest.raises(ConfigError, match=twice):
        config.load(run, check_inputs=False)
    run.write_text("optim:\n  lr_peak: 1.0e-3\n  lr_peak: 2.0e-3\n")  # within a section too
    with pytest.raises(ConfigError, match=r"key 'lr_peak' is given twice in one mapping \(lines 2 and 3\)"):
        config.load(run, check_inputs=False)


def test_save_round_trips(tmp_path):
    cfg = config.load(ROOT / "runs" / "tiny.yaml", ["optim.lr_peak=2e-3"])
    config.save(cfg, tmp_path / "config.yaml")
    again = config.load(tmp_path / "config.yaml")
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg) and again.plan == cfg.plan
    assert "plan" not in (tmp_path / "config.yaml").read_text()  # the plan is built at load, not a config key


@pytest.mark.parametrize("command, named, not_named", [
    ("prepare", ["data,", "data.deduplication"], ["optim", "trainer"]),
    ("train", ["run,", "model,", "data.deduplication", "optim,", "strategy.pipeline", "callbacks.loss_spike"], []),
    ("show", ["run,", "data.deduplication", "trainer,", "callbacks.stability_report"], []),
])
def test_each_subcommand_help_names_the_sections_its_keys_come_from(command, named, not_named, capsys):
    from lit_pretrain import cli

    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for section in named:
        assert section in text, section
    sections = text.split("lit_pretrain/schema.py):", 1)[1]
    for section in not_named:
        assert section not in sections, section


# --- what a config names outside itself -----------------------------------------------------------------------------

def test_one_string_is_a_one_element_list_on_the_command_line_and_in_a_file(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("one document\n")
    tiny = ROOT / "runs" / "tiny.yaml"
    # OmegaConf alone refuses it: "AnyNode is not a ListConfig, TupleConfig, list, or tuple".
    assert list(config.load(tiny, ["data=text", f"data.paths={corpus}"]).data.paths) == [str(corpus)]
    run = tmp_path / "mine.yaml"
    run.write_text(f"defaults: [base, {{model: tiny}}, {{data: text}}]\ndata:\n  paths: {corpus}\n"
                   f"  sources: [{{name: a, paths: {corpus}, weight: 1}}]\ntrainer: {{loggers: csv}}\n")
    cfg = config.load(run)
    assert list(cfg.data.paths) == [str(corpus)] and list(cfg.data.sources[0].paths) == [str(corpus)]
    assert list(cfg.trainer.loggers) == ["csv"]  # any list-of-strings key, not only paths
    assert list(config.load(tiny, ["data=text", f"data.paths=[{corpus},{corpus}/a.txt]"]).data.paths) == [
        str(corpus), f"{corpus}/a.txt"]  # a list is a list as before


def test_data_paths_are_checked_when_the_config_loads_and_show_refuses_them(tmp_path, capsys):
    from lit_pretrain import cli

    tiny = ROOT / "runs" / "tiny.yaml"
    missing = tmp_path / "no-such-corpus"
    with pytest.raises(ConfigError, match=rf"^data\.paths entry '{missing}' does not exist \(no such file or folder\): "
                                          "fix the path or remove it$"):
        config.load(tiny, ["data=text", f"data.paths=[{missing}]"])
    assert cli.main(["show", str(tiny), "data=jsonl", f"data.paths=[{tmp_path}/*.jsonl]"]) == 2
    assert f"data.paths entry '{tmp_path}/*.jsonl' matches no file" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"^data\.paths entry 'nowhere/x\.txt' does not exist \(no such file or "
                                          r"folder, looked for from the working directory /"):
        config.load(tiny, ["data=text", "data.paths=[nowhere/x.txt]"])
    # a mixture source: the key of its own paths, or data.paths where it has none
    (tmp_path / "a.txt").write_text("text\n")
    sources = f"data.sources=[{{name: a, paths: [{tmp_path / 'a.txt'}]}}, {{name: b, paths: [{missing}]}}]"
    with pytest.raises(ConfigError, match=r"^data\.sources\[1\]\.paths entry .* does not exist"):
        config.load(tiny, ["data.corpus=text", sources])


def test_paths_given_to_the_stdlib_corpus_are_refused_first_naming_the_presets(tmp_path):
    """data.paths set, data=text forgotten: the corpus ignores paths. Said before anything else (the next complaint
    would be that the stdlib prepared folder does not match the config)."""
    (tmp_path / "a.txt").write_text("text\n")
    tiny = ROOT / "runs" / "tiny.yaml"
    with pytest.raises(ConfigError, match=r"^data\.paths=\[.*a\.txt'\] is set but data\.corpus=stdlib reads the "
                                          r"Python standard library and ignores paths: choose the preset of your "
                                          r"files: data=text \(plain-text files.*data=jsonl or data=parquet"):
        config.load(tiny, [f"data.paths=[{tmp_path / 'a.txt'}]"])
    with pytest.raises(ConfigError, match=r"^data\.sources\[0\]\.paths=.* is set but data\.sources\[0\]\.corpus="
                                          r"stdlib .*: set data\.sources\[0\]\.corpus to the kind of your files"):
        config.load(tiny, [f"data.sources=[{{name: a, corpus: stdlib, paths: [{tmp_path / 'a.txt'}]}}]"])


# Every refusal `train` makes before its first step, fed to `show` (the CLI) and to `train` alike: each row's
# overrides, and a fragment of the one line both must print, so a row that trips another check fails too.
REFUSED = [
    (["schedule.warmup_steps=1000"], "schedule.warmup_steps=1000 exceeds trainer.max_steps=100"),
    (["schedule.lr_min=1.0"], "schedule.lr_min=1.0 exceeds optim.lr_peak"),
    (["trainer.devices=2"], "strategy.name=single runs one process, but trainer.devices=2"),
    (["trainer.devices=2", "strategy.name=ddp", "strategy.pipeline_parallel=2", "data.document_masking=true"],
     "data.document_masking=true is not supported with strategy.pipeline_parallel=2"),
    (["checkpoint.async_save=true"], "checkpoint.async_save=true writes sharded checkpoints in the background"),
    (["callbacks.loss_spike.threshold_sigmas=null"], "callbacks.loss_spike: set threshold_sigmas, threshold_ratio"),
    (["callbacks.downstream_eval.enabled=true", "callbacks.downstream_eval.tasks=[hellaswag]",
      "callbacks.downstream_eval.every_n_steps=7"], "callbacks.downstream_eval."),
    (["run.resume_allow_changes=[model.nope]"], "run.resume_allow_changes names 'model.nope', which is not a config"),
    (["trainer.device_memory_gb=0.001"], "trainer.device_memory_gb=0.001: the run needs"),
]


@pytest.mark.parametrize("overrides,message", REFUSED, ids=lambda v: v[-1] if isinstance(v, list) else None)
def test_show_refuses_exactly_what_train_refuses(overrides, message, tmp_path, capsys):
    from lit_pretrain import cli
    from lit_pretrain.train import train

    tiny = ROOT / "runs" / "tiny.yaml"
    assert cli.main(["show", str(tiny), *overrides]) == 2
    shown = capsys.readouterr().err.strip()
    assert shown.startswith("lit-pretrain show: error: ") and "\n" not in shown and message in shown
    # train, handed the same config by an older caller as an unchecked DictConfig, refuses it with the same line
    # before it makes anything (run.root_dir stays empty).
    good = config.load(tiny, [f"run.root_dir={tmp_path}"])
    sections = {f.name: getattr(good, f.name) for f in dataclasses.fields(Config)}
    unchecked = OmegaConf.merge(OmegaConf.structured(Config(**sections)), OmegaConf.from_dotlist(overrides))
    with pytest.raises(ConfigError) as refused:
        train(unchecked)
    assert shown == f"lit-pretrain show: error: {refused.value}"
    assert list(tmp_path.iterdir()) == []
