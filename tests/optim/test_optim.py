"""optim/ and StepGuard: one norm per optimizer step, a dropped update leaves no gradient, clipping by the norm the
guard was given, and the module's wiring of the guard into Lightning's step."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lit_pretrain import module as module_lib
from lit_pretrain.model.config import GPTConfig
from lit_pretrain.optim import optimizers as optim
from lit_pretrain.optim.optimizers import adamw_with_state, build_adamw, grad_norm, local_optimizer
from lit_pretrain.optim.step_guard import StepGuard
from lit_pretrain.schema import OptimConfig, ScheduleConfig


class CountingNorm:
    def __init__(self, fn=grad_norm):
        self.fn, self.calls = fn, 0

    def __call__(self, parameters):
        self.calls += 1
        return self.fn(parameters)


def hand_params():
    """Gradients (3, 0) and (0, 4): global L2 norm 5."""
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0])
    return [a, b]


def test_norm_is_computed_once_per_step_and_forgotten_on_the_next():
    params, norm_fn = hand_params(), CountingNorm()
    guard = StepGuard(norm_fn)
    guard.begin(7)
    first = guard.grad_norm(params)
    guard.begin(7)  # the next micro-batch of the same optimizer step
    assert guard.grad_norm(params) is first and first.item() == 5.0
    guard.clip(params, max_norm=10.0)
    assert norm_fn.calls == 1  # readers and clipping share one reduction
    guard.drop_update(params, torch.optim.SGD(params, lr=1.0), "non_finite")
    guard.begin(8)
    assert guard.dropped is None  # a new step starts clean
    for p, g in zip(params, ([6.0, 0.0], [0.0, 8.0])):
        p.grad = torch.tensor(g)
    assert guard.grad_norm(params).item() == 10.0 and norm_fn.calls == 2


def test_offered_values_reach_the_host_in_one_read_exactly_and_are_forgotten_on_the_next_step():
    guard, calls = StepGuard(), []

    def offered(key, value):
        def read():
            calls.append(key)
            return value
        return read

    guard.begin(3)
    third = torch.tensor(1 / 3, dtype=torch.float32)
    guard.offer("loss", offered("loss", third))
    guard.offer("bad", offered("bad", torch.tensor(True)))
    guard.offer("norm", offered("norm", torch.tensor(float("inf"))))
    guard.offer("loss", offered("again", torch.tensor(0.0)))  # the first offer of a key stands
    assert guard.host("bad") == 1.0 and calls == ["loss", "bad", "norm"]  # every offer evaluated at the first read
    assert guard.host("loss") == third.item() and guard.host("norm") == float("inf")  # float32 values exactly
    guard.offer("late", offered("late", torch.tensor(2.0)))
    assert guard.host("late") == 2.0 and calls == ["loss", "bad", "norm", "late"]  # read alone, nothing re-read
    guard.begin(4)
    with pytest.raises(KeyError):
        guard.host("loss")


def test_drop_update_clears_every_gradient_and_keeps_the_first_reason():
    model = torch.nn.Linear(3, 2)
    optimizer = build_adamw(model, OptimConfig())
    model(torch.ones(1, 3)).sum().backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    guard = StepGuard()
    guard.begin(0)
    guard.drop_update(model.parameters(), optimizer, "non_finite")
    guard.drop_update(model.parameters(), optimizer, "loss_spike")
    assert guard.dropped == "non_finite"
    assert all(p.grad is None for g in optimizer.param_groups for p in g["params"])
    assert guard.grad_norm(model.parameters()).item() > 0  # the pre-drop norm stays for the monitors
    assert guard.clip(model.parameters(), 1.0) is None  # nothing to clip, and no norm reported
    optimizer.step()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert optimizer.state_dict()["state"] == {}  # no moment, no step count


def test_clipping_factor_is_max_norm_over_the_global_norm():
    params = hand_params()
    norm = StepGuard().clip(params, max_norm=2.5)
    assert norm.item() == 5.0
    # One factor for both, torch's max_norm / (norm + 1e-6) = 2.5 / 5.000001; rtol 2e-7: torch forms the factor in
    # another float32 order, 1 ulp (8e-8 relative) off this one. A factor from any other norm is off by > 1e-2.
    factor = 2.5 / (5.0 + 1e-6)
    torch.testing.assert_close(params[0].grad, torch.tensor([3.0, 0.0]) * factor, rtol=2e-7, atol=0)
    torch.testing.assert_close(params[1].grad, torch.tensor([0.0, 4.0]) * factor, rtol=2e-7, atol=0)
    # The norm comes from outside (a layout's reduction over shards it cannot see here): clipping uses it.
    params = hand_params()
    StepGuard(lambda _: torch.tensor(10.0)).clip(params, max_norm=2.5)
    torch.testing.assert_close(params[1].grad, torch.tensor([0.0, 4.0]) * (2.5 / (10.0 + 1e-6)), rtol=2e-7, atol=0)


def test_saved_adamw_state_loads_into_a_fresh_one_process_adamw():
    torch.manual_seed(0)
    model, fresh = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)), None
    optimizer = build_adamw(model, OptimConfig(), kernel="foreach")  # as FSDP shards save it
    model(torch.ones(2, 4)).square().sum().backward()
    optimizer.step()
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    loaded = adamw_with_state(fresh, OptimConfig(), optimizer.state_dict())
    assert local_optimizer(loaded) is loaded
    pairs = zip((p for g in optimizer.param_groups for p in g["params"]),
                (p for g in loaded.param_groups for p in g["params"]))
    for p, q in pairs:
        assert torch.equal(optimizer.state[p]["exp_avg_sq"], loaded.state[q]["exp_avg_sq"])
    with pytest.raises(ValueError, match="kernel"):
        build_adamw(model, OptimConfig(), kernel="apex")


class DropStep(L.Callback):
    """Reads the guard as the stability callbacks do, and drops the update of optimizer step `step`."""

    def __init__(self, step):
        self.step, self.norms, self.params = step, {}, {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        guard = pl_module.step_guard
        self.norms[trainer.global_step] = guard.grad_norm(pl_module.parameters()).item()
        self.params[trainer.global_step] = [p.detach().clone() for p in pl_module.parameters()]
        if trainer.global_step == self.step:
            guard.drop_update(pl_module.parameters(), optimizer, "loss_spike")


def test_module_guard_under_the_trainer(tmp_path, monkeypatch):
    """3 optimizer steps of 2 micro-batches, the update of step 1 dropped: one norm per step (not per micro-batch),
    the dropped step changes no parameter and logs no grad_norm (gradient_clip_val's refusal: test_user_code.py)."""
    norm_fn = CountingNorm()
    # One process: the plan's norm (ParallelModel.grad_norm, chosen in on_fit_start) is optim.grad_norm's.
    monkeypatch.setattr(optim, "grad_norm", norm_fn)
    logged = []

    class Recording(module_lib.PretrainModule):
        def log(self, name, value, *args, **kwargs):
            if name == "train/grad_norm":
                logged.append(self.global_step)
            super().log(name, value, *args, **kwargs)

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, n_layers=1, d_model=16, n_heads=2, seq_len=8)
    module = Recording(cfg, OptimConfig(grad_clip_norm=0.5), ScheduleConfig(warmup_steps=0), max_steps=3,
                       tokens_per_step=16)
    data = torch.randint(0, 32, (12, 9))
    drop = DropStep(1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, accumulate_grad_batches=2, log_every_n_steps=1,
                        limit_val_batches=0, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, callbacks=[drop])
    trainer.fit(module, DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=2))
    assert norm_fn.calls == 3 and module.step_guard.step == 2
    assert logged == [0, 2]  # the steps clipped (0-based); the dropped one returned before logging
    assert all(torch.equal(a, b) for a, b in zip(drop.params[1], drop.params[2]))
    assert not all(torch.equal(a, b) for a, b in zip(drop.params[0], drop.params[1]))
