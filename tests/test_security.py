"""SECURITY.md, one test per row that can be tested: what the project reads never runs code.

Each hostile file below would leave a marker file behind if it ran anything; every test checks both that the
input is refused (or read as plain data) and that the marker was never written.
"""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from lit_pretrain import config
from lit_pretrain.callbacks.user import user_callbacks
from lit_pretrain.data.preparation.corpus import iter_documents
from lit_pretrain.data.shards import load_manifest, verify_shards
from lit_pretrain.errors import ConfigError, DataError
from lit_pretrain.resume.verified import load_verified, save_atomic
from lit_pretrain.schema import CallbacksConfig, CallbackSpec, DataConfig, DeduplicationConfig
from tests.conftest import EXPERIMENTS, ROOT, launcher_env

MARKER = "ran-code"


class _TouchOnUnpickle:
    """A pickled object whose unpickling would call Path.touch(marker): the shape of every pickle exploit."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_yaml_tag_cannot_construct_objects(tmp_path):
    marker = tmp_path / MARKER
    run = tmp_path / "hostile.yaml"
    run.write_text(f"run:\n  name: !!python/object/apply:pathlib.Path.touch [{marker}]\n")
    with pytest.raises(ConfigError, match="hostile.yaml is not valid YAML"):
        config.load(run)
    assert not marker.exists()


def test_checkpoint_with_code_is_refused(tmp_path):
    marker = tmp_path / MARKER
    path = tmp_path / "step0000001.ckpt"
    # The sidecar is written by save_atomic itself, so the checksum matches: this is a checkpoint whose integrity
    # holds but whose content is hostile. weights_only=True must refuse it after the checksum passed.
    save_atomic({"state_dict": {"model.w": torch.zeros(2)}, "payload": _TouchOnUnpickle(marker)}, path)
    with pytest.raises(DataError, match="step0000001.ckpt cannot be read as a weights-only checkpoint"):
        load_verified(path)
    assert not marker.exists()


def test_tokenizer_swap_is_refused(tiny_data_dir, tmp_path):
    folder = tmp_path / "prepared"
    shutil.copytree(tiny_data_dir, folder)
    manifest = load_manifest(folder)
    tokenizer = folder / manifest["tokenizer"]["file"]
    data = json.loads(tokenizer.read_text())
    data["added_tokens"][0]["content"] = "<|swapped|>"  # a tokenizer that parses but is not the one trained
    tokenizer.write_text(json.dumps(data))
    with pytest.raises(DataError, match="the tokenizer does not match the shards"):
        verify_shards(folder, manifest)


def test_corpus_code_is_never_run(tmp_path):
    marker = tmp_path / MARKER
    code = f"from pathlib import Path\nPath({str(marker)!r}).touch()\n"
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "doc.txt").write_text(code)
    (tmp_path / "corpus.jsonl").write_text(json.dumps({"text": code}) + "\n")
    for corpus, paths in (("text", [str(tmp_path / "corpus")]), ("jsonl", [str(tmp_path / "corpus.jsonl")])):
        docs = list(iter_documents(DataConfig(corpus=corpus, paths=paths)))
        assert [d.text for d in docs] == [code], corpus  # read back as the text it is
    assert not marker.exists()


@pytest.mark.parametrize("class_path", ["pathlib:Path", "builtins:exec", "os:system"])
def test_only_callback_classes_are_called(tmp_path, class_path):
    # Each of these would create, run or touch something if called with these arguments.
    spec = CallbackSpec(class_path=class_path, init_args={"x": f"open({str(tmp_path / MARKER)!r}, 'w')"})
    with pytest.raises(ConfigError, match="is not a Lightning Callback class"):
        user_callbacks(CallbacksConfig(extra=[spec]))
    assert not (tmp_path / MARKER).exists()


def test_a_config_names_code_only_as_module_colon_class():
    with pytest.raises(ConfigError, match=r"must be 'module:Class'"):
        config.load(EXPERIMENTS / "runs" / "tiny.yaml", ["callbacks.extra=[{class_path: os.system}]"])


def test_redis_defaults_to_loopback():
    assert DeduplicationConfig().redis_host == "127.0.0.1"


def test_servers_listen_on_loopback_only():
    assert launcher_env()["MASTER_ADDR"] == "127.0.0.1"
    # No source file binds or points a process group at a wildcard or non-loopback address.
    wildcard = re.compile(r"""0\.0\.0\.0|bind\(\(\s*["']["']|MASTER_ADDR["']?\s*[:=]\s*["'](?!127\.0\.0\.1)""")
    offenders = [f"{p.relative_to(ROOT)}:{i}" for folder in ("lit_pretrain", "tests")
                 for p in sorted((ROOT / folder).rglob("*.py")) if p.name != "test_security.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if wildcard.search(line)]
    assert offenders == []
    assert "--bind\", \"127.0.0.1\"" in (ROOT / "tests" / "data" / "test_deduplication.py").read_text()


@pytest.mark.parametrize("override", ["strategy=../../etc/x", "model=/tmp/x", "strategy=a/b", "model=.hidden/x"])
def test_group_choice_is_a_name_not_a_path(override):
    with pytest.raises(ConfigError, match="a config name is one file name"):
        config.load(EXPERIMENTS / "runs" / "tiny.yaml", [override])


def test_defaults_entry_is_a_name_not_a_path(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("defaults:\n  - ../../base\n")
    with pytest.raises(ConfigError, match="defaults entry='../../base'"):
        config.load(run)


def test_an_override_yaml_cannot_parse_is_a_config_error():
    with pytest.raises(ConfigError, match=r"cannot parse overrides on the command line \(run.name=\.\.\.\)"):
        config.load(EXPERIMENTS / "runs" / "tiny.yaml", ["run.name=..."])
