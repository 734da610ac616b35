"""PretrainModule: gradient clipping by global norm, AdamW parameter groups, the schedule stepped per optimizer step."""

import csv
import time

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT
from lit_pretrain.module import PretrainModule
from lit_pretrain.optim.optimizers import clip_by_global_norm, param_groups
from lit_pretrain.optim.schedule import lr_at
from lit_pretrain.schema import OptimConfig, ScheduleConfig

TINY = dict(vocab_size=97, n_layers=2, d_model=32, n_heads=4, seq_len=16)


def model_with_grads(seed=0, scale=1.0, tie=True):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**TINY, tie_embeddings=tie))
    x = torch.randint(0, 97, (3, 16))
    (model(x).square().mean() * scale).backward()
    return model


def global_norm(model):
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()


def test_clipping_above_threshold_rescales_to_exactly_the_threshold_in_the_same_direction():
    model = model_with_grads(scale=1e4)
    before = [p.grad.clone() for p in model.parameters()]
    norm_before = global_norm(model)
    assert norm_before > 1.0
    returned = clip_by_global_norm(model.parameters(), max_norm=1.0)
    assert returned.item() == pytest.approx(norm_before, rel=1e-6)  # the pre-clip norm is what is reported
    # torch scales by max_norm / (norm + 1e-6): the result is max_norm·norm/(norm + 1e-6), off by < 1e-6 relative.
    assert global_norm(model) == pytest.approx(1.0, rel=1e-6)
    # One factor for the whole gradient: every element is multiplied by the same scalar (so the direction holds).
    factor = 1.0 / (norm_before + 1e-6)
    for p, g in zip(model.parameters(), before):
        torch.testing.assert_close(p.grad, g * factor, rtol=1e-6, atol=0)


def test_clipping_below_threshold_changes_nothing():
    model = model_with_grads(scale=1e-3)
    before = [p.grad.clone() for p in model.parameters()]
    assert global_norm(model) < 1.0
    clip_by_global_norm(model.parameters(), max_norm=1.0)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before))


def test_clipping_matches_torch_clip_grad_norm_and_is_not_value_clamping():
    ours, ref = model_with_grads(scale=1e4), model_with_grads(scale=1e4)
    clip_by_global_norm(ours.parameters(), 0.5)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)
    clamped = model_with_grads(scale=1e4)
    for p in clamped.parameters():
        p.grad.clamp_(-0.5, 0.5)
    assert any(not torch.equal(a.grad, c.grad) for a, c in zip(ours.parameters(), clamped.parameters()))


def test_module_hook_clips_with_the_configured_norm():
    torch.manual_seed(0)
    module = PretrainModule(GPTConfig(**TINY), OptimConfig(grad_clip_norm=0.25), ScheduleConfig(warmup_steps=0),
                            max_steps=10, tokens_per_step=48)
    x = torch.randint(0, 97, (3, 17))
    module.loss((x[:, :-1], x[:, 1:])).mul(1e3).backward()
    module.configure_gradient_clipping(optimizer=None)
    assert global_norm(module.model) == pytest.approx(0.25, rel=1e-6)


@pytest.mark.parametrize("tie", [True, False])
def test_param_groups_decay_only_linear_weight_matrices(tie):
    model = GPT(GPTConfig(**TINY, tie_embeddings=tie))
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}  # named_parameters lists a tied tensor once
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in no_decay["params"]}
    linear = {f"blocks.{i}.{m}.weight" for i in range(2)
              for m in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w_gate", "mlp.w_up", "mlp.w_down")}
    # The untied head is a Linear weight matrix: decayed. Tied, it is the embedding: not decayed.
    assert decayed == (linear if tie else linear | {"lm_head.weight"})
    norms = {f"blocks.{i}.{n}.weight" for i in range(2) for n in ("attn_norm", "mlp_norm")} | {"norm.weight"}
    assert kept == norms | {"tok_embeddings.weight"}
    total = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    assert total == model.num_params(non_embedding=False)  # every parameter exactly once


def test_schedule_is_stepped_per_optimizer_step_under_accumulation(tmp_path):
    """6 optimizer steps of 2 micro-batches: the row of step s (optimizer steps completed, 1..6, on a plain Trainer
    too) holds the lr the step used, lr_at(s - 1) (lr_at counts from 0), and tokens_seen = s × tokens_per_step."""
    torch.manual_seed(0)
    sched = ScheduleConfig(kind="cosine", warmup_steps=2, lr_min=1e-4)
    module = PretrainModule(GPTConfig(**TINY), OptimConfig(lr_peak=1e-3), sched, max_steps=6,
                            tokens_per_step=2 * 4 * 16)
    data = torch.randint(0, 97, (48, 17))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, accumulate_grad_batches=2, log_every_n_steps=1,
                        logger=L.pytorch.loggers.CSVLogger(tmp_path, name="", version=""), limit_val_batches=0,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(module, loader)
    rows = [r for r in csv.DictReader(open(tmp_path / "metrics.csv")) if r.get("train/lr")]
    assert [int(r["step"]) for r in rows] == list(range(1, 7))
    expected = [lr_at(s, kind="cosine", lr_peak=1e-3, lr_min=1e-4, warmup_steps=2, max_steps=6) for s in range(6)]
    assert [float(r["train/lr"]) for r in rows] == pytest.approx(expected, rel=1e-6)
    assert [float(r["train/tokens_seen"]) for r in rows] == [s * 128 for s in range(1, 7)]
    assert all(float(r["train/grad_norm"]) > 0 for r in rows)


def test_validation_seconds_leave_out_what_callbacks_run_at_the_epoch_end(tmp_path):
    # Lightning calls callbacks' on_validation_epoch_end before the module's: the downstream evaluation runs there
    # and is timed as eval/seconds. val/seconds once counted it again (seen: evaluation_seconds above wall_seconds).
    class SlowEpochEnd(L.Callback):
        def on_validation_epoch_end(self, trainer, pl_module):
            time.sleep(0.5)

    x = torch.randint(0, 64, (2, 16))
    cfg = GPTConfig(vocab_size=64, n_layers=1, d_model=32, n_heads=2, seq_len=16)
    module = PretrainModule(cfg, OptimConfig(), ScheduleConfig(), max_steps=1, tokens_per_step=1, seed=0)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=tmp_path, callbacks=[SlowEpochEnd()])
    logged = trainer.validate(module, DataLoader(TensorDataset(x, x), batch_size=1), verbose=False)[0]
    # Two batches of 16 tokens through one 32-wide block take milliseconds: 0.5 s is far above them, even loaded.
    assert 0 < logged["val/seconds"] < 0.5


def test_a_module_without_a_trainer_computes_its_loss_through_a_one_process_parallel_model():
    """load_from_checkpoint and plain use never call configure_model: the parallel model exists all the same (a plan
    of one process), and its loss is model/losses.py on the GPT's own logits, bit for bit, with Lightning's backward
    to run (no schedule ran one)."""
    from lit_pretrain.model.losses import lm_losses

    torch.manual_seed(0)
    module = PretrainModule(GPTConfig(**TINY), OptimConfig(z_loss=1e-4), ScheduleConfig(), max_steps=1,
                            tokens_per_step=48)
    assert module.parallel.plan.world_size == 1 and module.parallel.gpt is module.model
    assert not module.parallel.runs_backward
    x = torch.randint(0, 97, (3, 17))
    batch = (x[:, :-1], x[:, 1:])
    task, z = lm_losses(module.model(batch[0]), batch[1], 1e-4)
    out = module.step_losses(batch)
    assert torch.equal(out.task, task) and torch.equal(out.z, z) and torch.equal(out.trained, task + z)
    assert out.metrics == {}


def test_an_accumulated_step_sees_every_micro_batch_gradient_and_the_next_step_starts_from_zero(tmp_path):
    """Gradients are zeroed before an accumulation's first micro-batch (on_train_batch_start), not by Lightning after
    its training step: what the optimizer steps on is the sum of the step's micro-batch gradients, each of the loss
    over 2, and nothing of the step before. Compared with the same sum computed by hand from the weights that step
    used; the same ops in the same order, so bit for bit."""
    from lit_pretrain.model.losses import lm_losses

    seen = []

    class Grads(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.append(({k: v.detach().clone() for k, v in pl_module.model.state_dict().items()},
                         {n: p.grad.clone() for n, p in pl_module.model.named_parameters()}))

    torch.manual_seed(0)
    module = PretrainModule(GPTConfig(**TINY), OptimConfig(lr_peak=1e-2), ScheduleConfig(warmup_steps=0),
                            max_steps=3, tokens_per_step=2 * 4 * 16)
    data = torch.randint(0, 97, (24, 17))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, accumulate_grad_batches=2, logger=False,
                        limit_val_batches=0, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, callbacks=[Grads()])
    trainer.fit(module, loader)
    assert len(seen) == 3
    for step, (weights, grads) in enumerate(seen):
        ref = GPT(GPTConfig(**TINY))
        ref.load_state_dict(weights)
        for i in (2 * step, 2 * step + 1):
            x, y = data[4 * i:4 * i + 4, :-1], data[4 * i:4 * i + 4, 1:]
            lm_losses(ref(x), y)[0].div(2).backward()  # Lightning's closure divides by the accumulation count
        for name, p in ref.named_parameters():
            assert torch.equal(grads[name], p.grad), (step, name)
