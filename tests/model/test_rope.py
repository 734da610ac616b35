"""RoPE scaling (model.rope_scaling): the inverse frequencies of Llama 3.1's rule and YaRN equal transformers' own
functions to the bit, and a Llama with rope_scaling imports and exports with transformers' logits at positions
beyond the original context. Nothing downloads: the Hugging Face models are built from configs here."""

import math

import pytest
import torch

from lit_pretrain.interop.hf import export_gpt, read_hf_config, read_hf_weights
from lit_pretrain.interop.llama import function_fields
from lit_pretrain.model.config import GPTConfig, RopeScalingConfig
from lit_pretrain.model.gpt import GPT
from lit_pretrain.model.rope import inverse_frequencies, llama3_inv_freq, yarn_attention_factor

transformers = pytest.importorskip("transformers")  # the hf extra: installed by `make install` and CI
pytest.importorskip("safetensors")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.modeling_rope_utils import _compute_llama3_parameters, _compute_yarn_parameters  # noqa: E402

LLAMA3 = RopeScalingConfig(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_seq_len=8192)


def hf_rope(scaling: RopeScalingConfig | None) -> dict:
    from lit_pretrain.interop.llama import rope_parameters

    return rope_parameters(GPTConfig(vocab_size=2, rope_theta=1.0, rope_scaling=scaling))


def hf_config(head_dim: int, theta: float, scaling: RopeScalingConfig, seq_len: int) -> LlamaConfig:
    rope = {**hf_rope(scaling), "rope_theta": theta}
    return LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim,
                       max_position_embeddings=seq_len, rope_parameters=rope)


def test_llama3_rule_by_hand_on_the_three_bands():
    # head_dim 16, theta 1e4: wavelengths 2π·1e4^(i/8) = 6.3, 19.9, 62.8, 199, 628, 1987, 6283, 19869. Original
    # context 1024, factors 1 and 4: kept below 1024/4 = 256 (i <= 3), divided by 8 above 1024/1 (i >= 5), and
    # i = 4 blended with weight s = (1024/628.3 - 1)/(4 - 1) = 0.2099 on the kept frequency (Meta's apply_scaling).
    inv = 1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    out = llama3_inv_freq(inv, 8.0, 1.0, 4.0, 1024)
    assert torch.equal(out[:4], inv[:4])
    assert torch.equal(out[5:], inv[5:] / 8)
    s = (1024 / (2 * math.pi / inv[4].item()) - 1) / 3
    assert s == pytest.approx(0.2099, abs=1e-4)
    assert out[4].item() == pytest.approx((1 - s) * inv[4].item() / 8 + s * inv[4].item(), rel=1e-6)


def test_yarn_attention_factor_is_eq_22():
    # YaRN (Peng et al. 2023) eq. 22: sqrt(1/t) = 0.1 ln(s) + 1; s = 16 (Llama 2 7B to 64K) gives 1.2773.
    assert yarn_attention_factor(16.0) == pytest.approx(1.27726, abs=1e-5)
    assert yarn_attention_factor(1.0) == 1.0 and yarn_attention_factor(4.0, 0.9) == 0.9


@pytest.mark.parametrize("head_dim,theta,scaling", [
    (128, 500000.0, LLAMA3),  # Llama 3.1 8B's own (meta-llama/Llama-3.1-8B config.json)
    (16, 10000.0, RopeScalingConfig(type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_seq_len=64)),
    (128, 10000.0, RopeScalingConfig(type="yarn", factor=16.0, original_seq_len=4096)),  # YaRN's Llama 2 64K
    (16, 10000.0, RopeScalingConfig(type="yarn", factor=4.0, original_seq_len=64, beta_fast=16.0, beta_slow=2.0,
                                    attention_factor=1.3)),
], ids=["llama3.1-8b", "llama3-tiny", "yarn-llama2-64k", "yarn-tiny"])
def test_inverse_frequencies_equal_transformers(head_dim, theta, scaling):
    compute = {"llama3": _compute_llama3_parameters, "yarn": _compute_yarn_parameters}[scaling.type]
    theirs, their_factor = compute(hf_config(head_dim, theta, scaling, 4 * scaling.original_seq_len))
    ours, our_factor = inverse_frequencies(head_dim, theta, scaling)
    assert torch.equal(ours, theirs)  # to the bit: same operations in the same order
    assert our_factor == their_factor
    unscaled, _ = inverse_frequencies(head_dim, theta)
    assert not torch.equal(ours, unscaled) and torch.equal(ours[0], unscaled[0])  # the fastest turn is kept


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    from lit_pretrain.data.tokenizer import save_tokenizer, train_tokenizer

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    save_tokenizer(train_tokenizer(["long context, scaled rope\n" * 3] * 20, 300), path)
    return path


def tiny_hf_llama(scaling: RopeScalingConfig, seed: int = 0) -> LlamaForCausalLM:
    """A random LlamaForCausalLM whose original context is 16 positions, run here to 64 (4x beyond it)."""
    torch.manual_seed(seed)
    rope = {**hf_rope(scaling), "rope_theta": 500.0}
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                         rope_parameters=rope, tie_word_embeddings=False, initializer_range=0.2,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("scaling", [
    RopeScalingConfig(type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_seq_len=16),
    RopeScalingConfig(type="yarn", factor=4.0, original_seq_len=16),
], ids=["llama3", "yarn"])
def test_scaled_llama_imports_and_exports_with_transformers_logits_beyond_the_original_context(tmp_path, scaling,
                                                                                               tokenizer_file):
    theirs = tiny_hf_llama(scaling)
    theirs.save_pretrained(tmp_path / "hf", safe_serialization=True)
    fields = read_hf_config(tmp_path / "hf")  # import: the refusal of rope_scaling is gone
    assert fields["seq_len"] == 64 and fields["rope_scaling"] == function_fields(GPTConfig(
        vocab_size=2, rope_scaling=scaling))["rope_scaling"]
    ours = GPT(GPTConfig(**fields)).eval()
    ours.load_state_dict({**read_hf_weights(tmp_path / "hf", tied=False)}, strict=True)
    idx = torch.randint(0, 320, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = theirs(idx).logits, ours(idx)
    # Positions 16..63 lie beyond the original context, where the scaled frequencies differ from unscaled ones.
    unscaled = GPT(GPTConfig(**{**fields, "rope_scaling": None})).eval()
    unscaled.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (unscaled(idx)[:, 16:] - want[:, 16:]).abs().max() > 1e-3  # the scaling shows in the logits
    # Same tables to the bit and the same operations (tests/interop/test_hf.py's measured rounding of SDPA in fp32):
    # 5e-5.
    assert (got - want).abs().max().item() <= 5e-5

    export_gpt(ours, tokenizer_file, tmp_path / "out")  # export: transformers reads our config.json as the same model
    again = LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert again.config.rope_parameters["rope_type"] == scaling.type
    with torch.no_grad():
        assert (again(idx).logits - want).abs().max().item() <= 5e-5
    assert read_hf_config(tmp_path / "out") == fields  # and back: a round trip of every field


def test_rope_scaling_refuses_inverted_bands():
    with pytest.raises(ValueError, match=r"model\.rope_scaling\.high_freq_factor=1\.0 must exceed"):
        GPT(GPTConfig(vocab_size=8, d_model=16, n_heads=2, rope_scaling=RopeScalingConfig(high_freq_factor=1.0)))
