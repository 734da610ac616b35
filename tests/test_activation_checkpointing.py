"""Activation checkpointing from outside the GPT: same math, fewer saved bytes by the factor the policy implies."""

import copy

import pytest
import torch
import torch.nn.functional as F

from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT
from lit_pretrain.parallel.activation_checkpointing import apply_activation_checkpointing, checkpointed_block_indices
from lit_pretrain.parallel.memory import SavedActivations

B, T, D = 2, 16, 32


def gpt(n_layers: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, n_layers=n_layers, d_model=D, n_heads=4, seq_len=T))


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 128, (B, T), generator=g), torch.randint(0, 128, (B, T), generator=g)


def step(model, mode="none", k=2):
    """Loss, gradients by name (as the plain GPT names them) and saved-activation bytes of one forward/backward."""
    model = copy.deepcopy(model)
    apply_activation_checkpointing(model, mode, k)
    x, y = batch()
    with SavedActivations(model) as meter:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    grads = {name.replace("_checkpoint_wrapped_module.", ""): p.grad for name, p in model.named_parameters()}
    return loss.detach(), grads, meter.bytes


@pytest.mark.parametrize("mode, n_layers, k, expected", [
    ("none", 4, 2, []),
    ("full", 4, 2, [0, 1, 2, 3]),
    ("every_k", 4, 2, [0, 2]),
    ("every_k", 5, 2, [0, 2, 4]),
    ("every_k", 6, 3, [0, 3]),
    ("every_k", 3, 1, [0, 1, 2]),
])
def test_policy_picks_blocks(mode, n_layers, k, expected):
    assert checkpointed_block_indices(mode, n_layers, k) == expected


def test_unknown_policy_names_the_key():
    with pytest.raises(ValueError, match=r"model\.activation_checkpointing='some'"):
        checkpointed_block_indices("some", 4)


@pytest.mark.parametrize("mode", ["full", "every_k"])
def test_losses_and_gradients_equal_without_it(mode):
    # Non-reentrant recomputation runs the same CPU kernels on the same inputs in the same order: bit-identical.
    loss_ref, grads_ref, _ = step(gpt(4))
    loss, grads, _ = step(gpt(4), mode)
    assert torch.equal(loss, loss_ref)
    assert grads.keys() == grads_ref.keys()
    for name, g in grads.items():
        assert torch.equal(g, grads_ref[name]), name


def test_saved_bytes_fall_by_the_factor_the_policy_implies():
    # Without checkpointing, each (identical) block adds the same saved bytes S: the difference of a 2- and a
    # 1-block model. A checkpointed block keeps only its input, B·T·d fp32 values, and nothing inside it.
    per_block = step(gpt(2))[2] - step(gpt(1))[2]
    block_input = B * T * D * 4
    none, full, every_2 = step(gpt(4))[2], step(gpt(4), "full")[2], step(gpt(4), "every_k", 2)[2]
    assert step(gpt(3))[2] == none - per_block  # linear in depth: the per-block figure is exact
    assert full == none - 4 * (per_block - block_input)
    assert every_2 == none - 2 * (per_block - block_input)  # blocks 0 and 2 of 4
    # For this shape a block saves 26x its input (q, k, v, attention output, SwiGLU hidden-width tensors, norms).
    assert per_block / block_input == pytest.approx(26.19, abs=0.01)


def test_checkpoint_names_stay_those_of_the_plain_gpt():
    plain = gpt(2)
    wrapped = copy.deepcopy(plain)
    assert apply_activation_checkpointing(wrapped, "full") == [0, 1]
    assert apply_activation_checkpointing(wrapped, "full") == [0, 1]  # idempotent: configure_model may run twice
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    wrapped.load_state_dict(plain.state_dict(), strict=True)
