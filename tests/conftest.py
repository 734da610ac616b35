"""Shared fixtures: one small prepared corpus for the whole session (tokenizer training is the slow part)."""

from pathlib import Path

import pytest
import torch

from lit_pretrain import config

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"

# Denormals slowed CPU steps 5x in measurements here (shared/CPU-DISTRIBUTED.md, pitfall 1).
torch.set_flush_denormal(True)


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory) -> Path:
    """400 documents of the default corpus, byte-level BPE with 512 tokens, prepared once."""
    from lit_pretrain.data.prepare import prepare

    folder = tmp_path_factory.mktemp("prepared") / "stdlib-tiny"
    cfg = config.to_object(config.load(EXPERIMENTS / "runs" / "tiny.yaml", tiny_data_overrides(folder)))
    prepare(cfg.data, log=lambda *_: None)
    return folder


def tiny_data_overrides(folder: Path) -> list:
    return [f"data.prepared_dir={folder}", "data.max_documents=400", "data.vocab_size=512"]
