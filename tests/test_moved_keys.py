"""Keys that moved out of the architecture config (config.MOVED): activation checkpointing to the strategy section,
FP8 to the trainer. Written the old way they still load, into their new place, with one line saying so: in a run
file, on the command line, in a finished run's config.yaml, in a checkpoint's hyperparameters and run metadata."""

import dataclasses
from pathlib import Path

import lightning
import pytest
import torch
import yaml

from lit_pretrain import config
from lit_pretrain.errors import ConfigError
from lit_pretrain.model.config import GPTConfig
from lit_pretrain.module import PretrainModule
from lit_pretrain.planning.plan import build_plan
from lit_pretrain.resume import compat
from lit_pretrain.resume.weights import from_plain
from lit_pretrain.schema import Float8Config, OptimConfig, ScheduleConfig, StrategyConfig

TINY = Path(__file__).resolve().parents[1] / "experiments" / "runs" / "tiny.yaml"
OLD = ["model.activation_checkpointing=every_k", "model.activation_checkpointing_k=3", "model.float8.recipe=tensorwise",
       "trainer.precision=bf16-mixed"]
NEW = ["strategy.activation_checkpointing=every_k", "strategy.activation_checkpointing_k=3",
       "trainer.float8.recipe=tensorwise", "trainer.precision=bf16-mixed"]
NOTICE = ("notice: {} uses moved config keys, read in their new place: model.activation_checkpointing -> "
          "strategy.activation_checkpointing, model.activation_checkpointing_k -> strategy.activation_checkpointing_k, "
          "model.float8 -> trainer.float8 (rename them there)\n")


def test_old_keys_on_the_command_line_load_into_their_new_place_with_one_line(capsys):
    capsys.readouterr()
    old = config.load(TINY, OLD, check_inputs=False)
    assert capsys.readouterr().err == NOTICE.format("the command line")
    new = config.load(TINY, NEW, check_inputs=False)
    assert capsys.readouterr().err == ""
    assert yaml.safe_load(config.to_yaml(old)) == yaml.safe_load(config.to_yaml(new))
    c = config.to_object(old)
    assert (c.strategy.activation_checkpointing, c.strategy.activation_checkpointing_k) == ("every_k", 3)
    assert c.trainer.float8 == Float8Config(recipe="tensorwise")
    assert not hasattr(c.model, "activation_checkpointing") and not hasattr(c.model, "float8")
    plan = build_plan(c)  # the plan takes them from their new sections
    assert (plan.activation_checkpointing, plan.activation_checkpointing_k) == ("every_k", 3)
    assert plan.float8 == Float8Config(recipe="tensorwise")


def test_an_old_run_file_and_an_old_finished_runs_config_yaml_load(tmp_path, capsys):
    data = yaml.safe_load(TINY.read_text())
    data["model"] = {"activation_checkpointing": "full", "activation_checkpointing_save_matmuls": "every_other"}
    data["trainer"]["precision"] = "bf16-mixed"
    data["model"]["float8"] = {"recipe": "rowwise", "exclude": ["attn.wo"]}
    run = tmp_path / "old.yaml"
    run.write_text(yaml.safe_dump(data))
    capsys.readouterr()
    c = config.to_object(config.load(run, check_inputs=False))
    assert capsys.readouterr().err.count("\n") == 1
    assert (c.strategy.activation_checkpointing, c.strategy.activation_checkpointing_save_matmuls) == \
        ("full", "every_other")
    assert c.trainer.float8 == Float8Config(recipe="rowwise", exclude=["attn.wo"])
    # A finished run's config.yaml as written before the move (every key resolved, the old ones in model:), the
    # file resume, generate, export and evaluate read: the same config as today's.
    today = config.load(TINY, ["strategy.activation_checkpointing=selective", "trainer.precision=bf16-mixed",
                               "trainer.float8={}"], check_inputs=False)
    written = yaml.safe_load(config.to_yaml(today))
    for key in ("activation_checkpointing", "activation_checkpointing_k", "activation_checkpointing_save_matmuls"):
        written["model"][key] = written["strategy"].pop(key)
    written["model"]["float8"] = written["trainer"].pop("float8")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(written))
    again = config.load(tmp_path / "config.yaml", check_inputs=False)
    assert yaml.safe_load(config.to_yaml(again)) == yaml.safe_load(config.to_yaml(today))
    with_matmuls = NOTICE.replace("model.float8", "model.activation_checkpointing_save_matmuls -> "
                                  "strategy.activation_checkpointing_save_matmuls, model.float8", 1)
    assert capsys.readouterr().err == with_matmuls.format(tmp_path / "config.yaml")


def test_an_old_key_beside_its_new_one_in_one_source_is_refused():
    with pytest.raises(ConfigError, match=r"config keys 'model\.activation_checkpointing' and "
                                          r"'strategy\.activation_checkpointing' are both given in the command line"):
        config.load(TINY, ["model.activation_checkpointing=full", "strategy.activation_checkpointing=none"],
                    check_inputs=False)
    # In different sources the later one wins, as for any key: the run file's new key, the command line's old one.
    c = config.to_object(config.load(TINY, ["model.activation_checkpointing=full"], check_inputs=False))
    assert c.strategy.activation_checkpointing == "full"


def test_a_removed_key_is_still_refused_naming_its_replacement():
    with pytest.raises(ConfigError, match=r"config key 'trainer\.val_batches' in the command line was replaced"):
        config.load(TINY, ["trainer.val_batches=4"], check_inputs=False)


def old_hyperparameters():
    """PretrainModule's hyperparameters as a checkpoint written before the move holds them (plain data)."""
    model = {**dataclasses.asdict(GPTConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=2, seq_len=16)),
             "activation_checkpointing": "full", "activation_checkpointing_k": 2,
             "activation_checkpointing_save_matmuls": "all", "float8": {"recipe": "rowwise", "exclude": [],
                                                                       "fsdp_float8_all_gather": False}}
    strategy = {k: v for k, v in dataclasses.asdict(StrategyConfig(name="ddp")).items()
                if not k.startswith("activation_checkpointing")}
    return {"model_cfg": model, "optim": dataclasses.asdict(OptimConfig()),
            "schedule": dataclasses.asdict(ScheduleConfig()), "max_steps": 10, "tokens_per_step": 64, "seed": 0,
            "strategy": strategy, "compile": False, "eod_id": None, "schedule_pieces": None}


def test_an_old_checkpoint_loads_with_its_keys_routed(tmp_path, capsys):
    hparams = old_hyperparameters()
    capsys.readouterr()
    assert from_plain(GPTConfig, hparams["model_cfg"]) == GPTConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=2,
                                                                    seq_len=16)
    assert "model.float8 -> trainer.float8" in capsys.readouterr().err
    torch.manual_seed(0)
    reference = PretrainModule(**{**hparams, "model_cfg": from_plain(GPTConfig, hparams["model_cfg"])})
    path = tmp_path / "old.ckpt"
    torch.save({"state_dict": reference.state_dict(), "hyper_parameters": hparams,
                "pytorch-lightning_version": lightning.__version__}, path)
    capsys.readouterr()
    module = PretrainModule.load_from_checkpoint(path)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("notice: the checkpoint's hyperparameters uses moved config keys")
    assert "model.activation_checkpointing -> strategy.activation_checkpointing" in err
    assert module.model_cfg == reference.model_cfg
    assert module.strategy_cfg == StrategyConfig(name="ddp", activation_checkpointing="full")
    for (name, a), b in zip(module.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name
    # Saved again, it holds today's keys.
    assert "activation_checkpointing" not in module.hparams["model_cfg"]
    assert module.hparams["strategy"]["activation_checkpointing"] == "full"


def test_an_old_checkpoints_run_metadata_resumes_under_the_moved_keys():
    manifest = {"tokenizer": {"sha256": "t"}, "splits": {"train": {"shards": [{"file": "a", "tokens": 1,
                                                                              "sha256": "s"}]}}}
    before = {"model": {"d_model": 64, "activation_checkpointing": "full", "float8": {"recipe": "rowwise"}},
              "trainer": {"precision": "bf16-mixed"}, "strategy": {"name": "ddp"}}
    saved = compat.run_meta(before, manifest, 512)
    now = {"model": {"d_model": 64}, "trainer": {"precision": "bf16-mixed", "float8": {"recipe": "rowwise"}},
           "strategy": {"name": "ddp", "activation_checkpointing": "none"}}
    # activation checkpointing is free (a strategy key); the same FP8 recipe under its new name is no change
    assert compat.check_resume(saved, compat.run_meta(now, manifest, 512), [], "c", "t") == []
    other = {**now, "trainer": {"precision": "bf16-mixed", "float8": {"recipe": "tensorwise"}}}
    with pytest.raises(ConfigError, match=r"trainer\.float8\.recipe is 'tensorwise' here but 'rowwise' in checkpoint"):
        compat.check_resume(saved, compat.run_meta(other, manifest, 512), [], "c", "t")
    assert compat.check_resume(saved, compat.run_meta(other, manifest, 512), ["trainer.float8"], "c", "t") == \
        ["trainer.float8.recipe"]
