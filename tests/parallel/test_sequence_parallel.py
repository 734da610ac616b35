"""Sequence parallelism's checks that need no process group (the parity and activation measurements run in the
2- and 4-process spawns of tests/parallel/test_mesh_parallel.py)."""

import pytest
import torch

from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT
from lit_pretrain.parallel.sequence import check_seq_len, sequence_parallel_params


def test_seq_len_not_divisible_by_the_tensor_degree_names_both_keys():
    check_seq_len(16, 2)
    with pytest.raises(ValueError, match=r"model\.seq_len=18 .*strategy\.tensor_parallel=4"):
        check_seq_len(18, 4)


def test_the_synced_parameters_are_exactly_the_norm_weights():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=4, seq_len=16))
    names = {id(p): n for n, p in model.named_parameters()}
    assert [names[id(p)] for p in sequence_parallel_params(model)] == [
        "blocks.0.attn_norm.weight", "blocks.0.mlp_norm.weight", "blocks.1.attn_norm.weight",
        "blocks.1.mlp_norm.weight", "norm.weight"]


def test_attention_takes_the_first_rows_of_longer_rope_tables():
    # A pipeline stage passes the whole tables (under sequence parallelism it cannot know T): same output.
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layers=1, d_model=32, n_heads=4, seq_len=16))
    h = torch.randn(2, 12, 32)
    block = model.blocks[0]
    cut = block(h, model.rope_cos[:12], model.rope_sin[:12])
    assert torch.equal(block(h, model.rope_cos, model.rope_sin), cut)
