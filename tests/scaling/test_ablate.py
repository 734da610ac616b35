"""`make ablate`'s runner: the shipped ablation files compose into loadable configs, bad files are refused naming the
key, and the table and plot are written from the arms' run folders (training replaced by canned run folders)."""

import json
from operator import attrgetter

import pytest

from lit_pretrain import config
from lit_pretrain.errors import ConfigError
from lit_pretrain.scaling import ablate

SHIPPED = sorted(ablate.ABLATIONS.glob("*.yaml"))
ARCH_KEYS = ("model.qk_norm", "model.n_kv_heads")  # the architecture variants' keys


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_arm_loads_and_differs_only_by_its_own_overrides(path):
    ab = ablate.load_ablation(path)
    loaded = {}
    for arm, extra in ab.arms.items():
        try:
            loaded[arm] = config.load(ab.run_file, [*ab.overrides, *extra])
        except ConfigError as err:
            if any(f"'{k}'" in str(err) for k in ARCH_KEYS):
                pytest.skip(f"{path.name} needs {ARCH_KEYS} (the architecture variants)")
            raise
    first, *rest = loaded.values()
    for arm, cfg in zip(list(loaded)[1:], rest):  # equal tokens: the same steps, batch and seed in every arm
        for key in ("trainer.max_steps", "trainer.micro_batch_size", "run.seed", "model.seq_len"):
            assert attrgetter(key)(cfg) == attrgetter(key)(first), (arm, key)


@pytest.mark.parametrize("text, expected", [
    ("run: x.yaml\narms: {a: []}\n", "at least two arm names"),
    ("run: x.yaml\narms: {a: [], b: []}\nsteps: 3\n", "expected a mapping of description, run, overrides, arms"),
    ("run: x.yaml\narms: {a: [], '../b': []}\n", r"arms\.\.\./b: an arm is a folder name"),
])
def test_bad_ablation_files_are_refused_naming_the_key(tmp_path, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=expected):
        ablate.load_ablation(path)


def test_table_and_plot_come_from_the_arm_runs(tmp_path, monkeypatch):
    folder = tmp_path / "ablations"
    folder.mkdir()
    (folder / "pair.yaml").write_text("description: two arms\nrun: x.yaml\narms: {a: [], b: [optim.name=muon]}\n")
    root = tmp_path / "runs"

    def fake_train(ab, arm, root_, log):
        run_dir = root_ / ab.name / arm
        run_dir.mkdir(parents=True)
        bpb = {"a": 2.5, "b": 2.25}[arm]
        (run_dir / "metrics.csv").write_text(f"step,train/loss,val/bits_per_byte\n1,5.0,\n2,4.0,\n2,,{bpb}\n")
        summary = {"tokens_per_step": 512, "steps": 2, "tokens_seen": 1024, "final_val_loss": bpb * 0.69,
                   "val_bits_per_byte": bpb}
        (run_dir / "summary.json").write_text(json.dumps(summary))
        return summary

    monkeypatch.setattr(ablate, "train_arm", fake_train)
    text = ablate.run(folder=folder, root=root, log=lambda *_: None)
    assert "| pair | a | 2.5000 |" in text and "| pair | b | 2.2500 |" in text
    assert (root / "ablations.md").read_text() == text
    assert (root / "ablations.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ConfigError, match="no .*/nope.yaml; choose from pair"):
        ablate.run(["nope"], folder=folder, root=root)
