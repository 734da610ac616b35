"""optim/named_state.py: the optimizer state of a one-file checkpoint keyed by parameter name, and files numbered by
position before it (in the groups, or in `model.parameters()` as Lightning's ZeRO-2/3 file was) read by name.
The layouts that resume such files are driven end to end in tests/resume/test_resume.py."""

import dataclasses

import lightning as L
import pytest
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import OptimStateKeyType
from torch.utils.data import DataLoader, TensorDataset

from lit_pretrain.errors import DataError
from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT
from lit_pretrain.module import PretrainModule
from lit_pretrain.optim.named_state import names_of, read_named, single_process_names, to_named, to_positions
from lit_pretrain.optim.optimizers import adamw_with_state, build_optimizer
from lit_pretrain.resume.checkpoint_io import AtomicCheckpointIO
from lit_pretrain.resume.verified import load_verified
from lit_pretrain.resume.weights import load_optimizer_state
from lit_pretrain.schema import OptimConfig, ScheduleConfig

CFG = GPTConfig(vocab_size=32, n_layers=2, d_model=16, n_heads=2, seq_len=8)


def stepped(optim: OptimConfig, steps: int = 2):
    """A GPT and its optimizer after `steps` updates on random tokens: every parameter has state."""
    torch.manual_seed(0)
    model = GPT(CFG)
    optimizer = build_optimizer(model, optim)
    for _ in range(steps):
        x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1))
        torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def assert_state_of(model, optimizer, named):
    """`named` holds, under each parameter's name, exactly the live state of that parameter."""
    live = {n: optimizer.state[p] for n, p in model.named_parameters()}
    assert named["state"].keys() == live.keys()
    for name, state in live.items():
        assert named["state"][name].keys() == state.keys(), name
        assert all(torch.equal(named["state"][name][k], v) for k, v in state.items()), name


def test_one_process_checkpoint_keys_optimizer_state_by_name(tmp_path):
    """A one-process Lightning run's file (the numbering Lightning's own strategies save is by position; on main the
    file held 0, 1, 2, ...) holds the optimizer state and its groups by parameter name, and reads back by name."""
    torch.manual_seed(0)
    module = PretrainModule(CFG, OptimConfig(), ScheduleConfig(warmup_steps=0), max_steps=2, tokens_per_step=16)
    data = torch.randint(0, CFG.vocab_size, (8, CFG.seq_len + 1))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, limit_val_batches=0, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        plugins=[AtomicCheckpointIO()])
    trainer.fit(module, DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=2))
    path = tmp_path / "one.ckpt"
    trainer.save_checkpoint(path)
    saved = load_verified(path)["optimizer_states"][0]
    groups = single_process_names(CFG, OptimConfig()).groups
    assert [g["params"] for g in saved["param_groups"]] == groups  # decayed matrices, then the rest
    assert groups[0][0] == "blocks.0.attn.wq.weight" and groups[1][0] == "tok_embeddings.weight"
    assert_state_of(module.model, trainer.optimizers[0], saved)
    loaded = load_optimizer_state(path, model=module.model)  # by name into one process
    for p in module.model.parameters():
        assert all(torch.equal(loaded.state[p][k], v) for k, v in trainer.optimizers[0].state[p].items())


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_both_older_numberings_read_by_name(name):
    """Files numbered by position in the groups (one process, DDP, ZeRO-1, the mesh, consolidate) and by position in
    `model.parameters()` (Lightning's ZeRO-2/3 file, made here by Lightning's own rekeying) both read into the same
    by-name state, and that state loads into a fresh optimizer bitwise."""
    optim = OptimConfig(name=name)
    model, optimizer = stepped(optim)
    names = names_of(model, optim)
    positional = optimizer.state_dict()
    named = read_named(positional, names, "step.ckpt")
    assert_state_of(model, optimizer, named)
    assert to_named(positional, names.groups)["state"].keys() == named["state"].keys()
    # Lightning's ZeRO-2/3 one-file numbering: each group's positions sorted, not 0, 1, 2, ... in order
    by_parameters = FSDP.rekey_optim_state_dict(named, OptimStateKeyType.PARAM_ID, model)
    flat = [i for g in by_parameters["param_groups"] for i in g["params"]]
    assert flat != list(range(len(flat)))  # the groups' order is not `parameters()`'s: the two numberings differ
    assert_state_of(model, optimizer, read_named(by_parameters, names, "step.ckpt"))
    fresh = adamw_with_state(GPT(CFG), optim, to_positions(named, names.groups, "step.ckpt"))
    assert fresh.state_dict()["param_groups"] == positional["param_groups"]
    for a, b in zip(fresh.state_dict()["state"].values(), positional["state"].values()):
        assert all(torch.equal(a[k], v) for k, v in b.items())


def test_state_of_other_groups_is_refused_with_the_fix():
    optim = OptimConfig()
    model, optimizer = stepped(optim, steps=1)
    named = to_named(optimizer.state_dict(), names_of(model, optim).groups)
    other = names_of(model, OptimConfig(no_weight_decay=["norms"]))  # biases and embeddings decayed: regrouped
    with pytest.raises(DataError, match=r"step\.ckpt: its optimizer groups .* optim\.no_weight_decay.*run\.init_from"):
        to_positions(named, other.groups, "step.ckpt")
    with pytest.raises(DataError, match=r"step\.ckpt: its optimizer state does not fit this model"):
        read_named(optimizer.state_dict(), names_of(GPT(dataclasses.replace(CFG, n_layers=1)), optim),
                   "step.ckpt")
