"""The model presets of experiments/model/ (the ladder's rungs and Llama 3's published shapes): every preset built on
the meta device has the parameter count of the architecture table and of its file's comment; the published shapes
have their published counts, and transformers' LlamaForCausalLM built from the same config has the same."""

import pytest
import torch
import yaml

from lit_pretrain.model import shapes
from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT
from tests.conftest import EXPERIMENTS

MODELS = EXPERIMENTS / "model"
# The published totals: Llama 3.2 1B and 3B (tied) and Llama 3.1 8B (untied), their model cards / config.json.
PUBLISHED = {"llama3_2_1b": 1_235_814_400, "llama3_2_3b": 3_212_749_824, "llama3_1_8b": 8_030_261_248,
             "llama3_1_8b_128k": 8_030_261_248}
# meta-llama/Llama-3.1-8B config.json as released: the 128K preset exports exactly this (RoPE scaling, no weight).
LLAMA3_1_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}
# The family's rungs: (total, non-embedding) at the 128,256-token vocabulary, as each file's comment states them.
LADDER = {
    "ladder_14m": (16_908_928, 492_160), "ladder_30m": (36_636_928, 3_803_392),
    "ladder_60m": (62_231_424, 12_981_120), "ladder_124m": (117_680_832, 43_805_376),
    "ladder_350m": (374_637_568, 243_303_424), "ladder_760m": (728_785_344, 556_409_280),
    "ladder_1b": (1_018_111_488, 821_110_272), "ladder_3b": (3_098_513_664, 2_803_011_840),
    "ladder_8b": (8_193_961_600, 7_373_123_200),
}
PRESETS = sorted({*PUBLISHED, *LADDER})


def preset(name: str) -> GPTConfig:
    return GPTConfig(**yaml.safe_load((MODELS / f"{name}.yaml").read_text()))


def test_every_preset_file_is_listed_here():
    # tiny and small: the CPU runs' models; olmoe_1b_7b: the mixture-of-experts preset (tests/model/test_moe.py counts
    # it)
    shipped = {p.stem for p in MODELS.glob("*.yaml")} - {"tiny", "small", "olmoe_1b_7b"}
    assert shipped == set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_count_on_the_meta_device_equals_the_table_and_the_comment(name):
    cfg = preset(name)
    cfg.check()
    with torch.device("meta"):
        model = GPT(cfg)
    built = sum(p.numel() for p in model.parameters())  # a tied head is the embedding's Parameter: counted once
    assert built == shapes.params(cfg)
    total = PUBLISHED.get(name) or LADDER[name][0]
    assert built == total
    if name in LADDER:
        assert shapes.non_embedding_params(cfg) == LADDER[name][1]
    # The count in the file's comment is the exact one (a reader sizes a run by it).
    assert f"{total:,}" in (MODELS / f"{name}.yaml").read_text()
    # The family: Llama 3's block (RoPE theta 500,000, RMSNorm eps 1e-5, SwiGLU, grouped-query attention).
    assert (cfg.rope_theta, cfg.norm_eps, cfg.norm, cfg.mlp) == (500000.0, 1e-5, "rmsnorm", "swiglu")
    assert cfg.kv_heads < cfg.n_heads and cfg.vocab_size == 128256


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_shape_counts_equal_transformers_llama(name):
    from transformers import LlamaConfig, LlamaForCausalLM

    from lit_pretrain.interop.llama import to_llama_config

    cfg = preset(name)
    exported = to_llama_config(cfg, eod_id=0, dtype="float32")
    if name == "llama3_1_8b_128k":
        assert exported["rope_scaling"] == LLAMA3_1_ROPE and exported["max_position_embeddings"] == 131072
    elif name == "llama3_1_8b":  # the pretraining shape: unscaled, 8K
        assert exported["rope_scaling"] is None and exported["max_position_embeddings"] == 8192
    with torch.device("meta"):
        hf = LlamaForCausalLM(LlamaConfig(**exported))
    assert sum(p.numel() for p in hf.parameters()) == PUBLISHED[name] == shapes.params(cfg)
    # Tensor by tensor: the same multiset of shapes (the tied head is not a separate tensor in either).
    ours = sorted(tuple(s) for s in shapes.param_shapes(cfg).values())
    assert ours == sorted(tuple(p.shape) for p in hf.parameters())


def test_ladder_rungs_grow_and_keep_the_depth_dial():
    rungs = sorted(LADDER, key=lambda n: LADDER[n][0])
    assert [r.removeprefix("ladder_") for r in rungs] == ["14m", "30m", "60m", "124m", "350m", "760m", "1b", "3b",
                                                         "8b"]
    for name in rungs:
        cfg = preset(name)
        # nanochat's depth dial: d_model = 64 x depth; OLMo 2's SwiGLU width 4 x d_model
        assert cfg.d_model == 64 * cfg.n_layers and cfg.d_ff == 4 * cfg.d_model
