"""The optimizer-side knobs by their meaning: z-loss's gradient, Muon's step against a Newton–Schulz step
written from the paper, μP's coordinate check, weight-decay exclusions and learning-rate factors by parameter kind,
the combined Muon/AdamW state's round trip, Muon's whole-matrix step against torch.optim.Muon, and the refusals at
config load (the parallel layouts' Muon parity is in tests/parallel/test_mesh_parallel.py)."""

import io
import math

import pytest
import torch
import torch.nn.functional as F

from lit_pretrain import config
from lit_pretrain.errors import ConfigError
from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT
from lit_pretrain.module import IGNORE_INDEX, lm_losses
from lit_pretrain.optim.optimizers import MuonWithAdamW, build_optimizer, is_muon_group, param_groups
from lit_pretrain.optim.schedule import lr_lambda
from lit_pretrain.schema import OptimConfig, ScheduleConfig
from tests.conftest import EXPERIMENTS

TINY = dict(vocab_size=64, n_layers=2, d_model=32, n_heads=2, seq_len=16)


def names_of(model, params):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)] for p in params}


def test_z_loss_value_and_gradient_are_palms_formula_over_predicted_targets():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 5, 11, generator=g, dtype=torch.float64) * 3).requires_grad_()
    y = torch.randint(0, 11, (2, 5), generator=g)
    y[0, 1] = y[1, 4] = IGNORE_INDEX  # not predicted (document masking): no z-loss either
    task, z = lm_losses(logits, y, z_loss=1e-4)
    kept = y.flatten() != IGNORE_INDEX
    flat = logits.detach().flatten(0, 1)[kept]  # (8, 11)
    log_z = flat.exp().sum(-1).log()  # log Z written out, not logsumexp
    # lm_losses computes in float32 (as training does): agreement to float32's precision.
    assert z.item() == pytest.approx(1e-4 * log_z.square().mean().item(), rel=1e-6)
    assert task.item() == pytest.approx(F.cross_entropy(flat, y.flatten()[kept]).item(), rel=1e-6)
    # d/dlogits of c·mean(log Z²) = 2c·log Z·softmax(logits)/n on predicted rows, 0 on the others.
    (grad,) = torch.autograd.grad(z, logits)
    expected = torch.zeros_like(grad).flatten(0, 1)
    expected[kept] = 2e-4 * log_z[:, None] * flat.softmax(-1) / kept.sum()
    assert torch.allclose(grad.flatten(0, 1), expected, rtol=1e-5, atol=1e-12)
    assert lm_losses(logits, y)[1] is None  # off by default: nothing added


def newton_schulz_reference(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Jordan et al. 2024's quintic iteration X <- aX + (bA + cA²)X, A = XXᵀ, on G/||G||_F (so every singular value
    is at most 1), written out in float64 on the wide orientation."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    x = (x.T if tall else x) / x.norm()
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


@pytest.mark.parametrize("shape", [(24, 48), (48, 24)])
def test_torch_muon_two_steps_match_a_reference_newton_schulz_step(shape):
    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(shape, generator=g)
    grads = [torch.randn(shape, generator=g) for _ in range(2)]
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.Muon([p], lr=0.1, weight_decay=0.0, momentum=0.95, nesterov=True, adjust_lr_fn="original")
    buf = torch.zeros(shape, dtype=torch.float64)
    scale = math.sqrt(max(1.0, shape[0] / shape[1]))  # the "original" shape factor
    for grad in grads:
        before = p.detach().double().clone()
        p.grad = grad.clone()
        opt.step()
        buf = 0.95 * buf + grad  # momentum, then Nesterov's look-ahead
        reference = newton_schulz_reference(grad + 0.95 * buf)
        update = (before - p.detach().double()) / (0.1 * scale)
        # torch iterates in bfloat16 (8 significant bits, ~4e-3 per rounding, over 5 iterations of 3 matmuls):
        # measured 1.5-1.8e-2 relative; the raw direction (not orthogonalized, rescaled) is 0.4-0.6 away.
        assert ((update - reference).norm() / reference.norm()).item() < 4e-2
        raw = (grad + 0.95 * buf) / (grad + 0.95 * buf).norm() * reference.norm()
        assert ((raw - reference).norm() / reference.norm()).item() > 0.2  # the check can tell them apart


def coordinate_scale(init: str, width: int) -> float:
    """Mean |block output - block input| over both blocks after 4 Adam steps at one learning rate (Yang et al. 2022,
    Tensor Programs V, §D.1's coordinate check)."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, n_layers=2, d_model=width, n_heads=width // 16, seq_len=16, init=init,
                    mup_base_width=32, tie_embeddings=False)
    model = GPT(cfg)
    opt = build_optimizer(model, OptimConfig(lr_peak=1e-2, weight_decay=0.0))
    x = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(1))
    for _ in range(4):
        F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
    sizes = []
    hooks = [b.register_forward_hook(lambda m, i, o: sizes.append((o - i[0]).abs().mean().item()))
             for b in model.blocks]
    with torch.no_grad():
        model(x[:, :-1])
    for h in hooks:
        h.remove()
    return sum(sizes) / len(sizes)


def test_mup_coordinate_check_is_flat_in_width_and_standard_is_not():
    # Width x4 (32 -> 128): measured x0.8 under mup, x29 under standard. One thread: 0.5 s instead of 10 s on the
    # shared 2 cores (small matmuls lose more to thread handoffs than they gain).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        growth = {init: coordinate_scale(init, 128) / coordinate_scale(init, 32) for init in ("mup", "standard")}
    finally:
        torch.set_num_threads(threads)
    assert 0.5 < growth["mup"] < 2.0, growth
    assert growth["standard"] > 4.0, growth


def test_mup_at_the_base_width_is_the_default_init_and_scales_hidden_rates():
    torch.manual_seed(0)
    base = GPT(GPTConfig(**TINY))
    torch.manual_seed(0)
    same = GPT(GPTConfig(**TINY, init="mup", mup_base_width=32))
    assert all(torch.equal(a, b) for a, b in zip(base.state_dict().values(), same.state_dict().values()))
    wide = GPT(GPTConfig(**{**TINY, "d_model": 128}, init="mup", mup_base_width=32, tie_embeddings=False))
    groups = param_groups(wide, OptimConfig(lr_peak=1e-2))
    hidden = [g for g in groups if g.get("lr_multiplier") == 0.25]
    assert len(hidden) == 1 and hidden[0]["lr"] == pytest.approx(2.5e-3)
    assert names_of(wide, hidden[0]["params"]) == {n for n, p in wide.named_parameters()
                                                   if p.ndim == 2 and n.startswith("blocks.")}
    x = torch.randint(0, 64, (1, 4))
    wide.lm_head.output_multiplier = 1.0
    plain = wide(x)
    wide.lm_head.output_multiplier = 0.25
    assert torch.allclose(wide(x), plain * 0.25)  # μP's readout multiplier b/n on the logits


def test_weight_decay_exclusions_and_lr_factors_follow_the_config():
    model = GPT(GPTConfig(**TINY, tie_embeddings=False))
    default = param_groups(model, OptimConfig())
    assert [sorted(g) for g in default] == [["params", "weight_decay"]] * 2  # today's two groups, nothing added
    o = OptimConfig(no_weight_decay=["embeddings", "norms", "head", "blocks.*.attn.wo.weight"],
                    lr_multipliers={"embeddings": 10.0, "head": 0.5})
    groups = param_groups(model, o)
    decayed = set().union(*(names_of(model, g["params"]) for g in groups if g["weight_decay"] > 0))
    assert decayed == {n for n, p in model.named_parameters()
                       if n.startswith("blocks.") and p.ndim == 2 and ".attn.wo." not in n}
    by_factor = {g.get("lr_multiplier", 1.0): names_of(model, g["params"]) for g in groups if g["params"]}
    assert by_factor[10.0] == {"tok_embeddings.weight"} and by_factor[0.5] == {"lm_head.weight"}
    # The schedule multiplies each group's own base: lr_peak x factor x the schedule's factor.
    opt = build_optimizer(model, o)
    sched = ScheduleConfig(kind="cosine", warmup_steps=2, lr_min=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(sched, o.lr_peak, 10))
    for _ in range(3):
        opt.step()
        scheduler.step()
    factor = lr_lambda(sched, o.lr_peak, 10)(3)
    for g in opt.param_groups:
        assert g["lr"] == pytest.approx(o.lr_peak * g.get("lr_multiplier", 1.0) * factor)


def test_muon_takes_hidden_matrices_and_its_state_round_trips_bitwise():
    def build():
        torch.manual_seed(0)
        model = GPT(GPTConfig(**TINY))
        return model, build_optimizer(model, OptimConfig(name="muon", lr_peak=1e-2))

    def step(model, opt, seed):
        x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(seed))
        F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()

    model, opt = build()
    assert isinstance(opt, MuonWithAdamW)
    muon = set().union(*(names_of(model, g["params"]) for g in opt.param_groups if g.get("use_muon")))
    assert muon == {n for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2}
    for seed in (1, 2):
        step(model, opt, seed)
    buffer = io.BytesIO()  # through a file's bytes, as a checkpoint: state_dict() holds the live tensors
    torch.save(opt.state_dict(), buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert {k for s in saved["state"].values() for k in s} == {"momentum_buffer", "step", "exp_avg", "exp_avg_sq"}
    other, reloaded = build()
    other.load_state_dict(model.state_dict())
    reloaded.load_state_dict(saved)
    step(model, opt, 3)
    step(other, reloaded, 3)
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name


class WholeOnEveryRank:
    """A layout whose matrices are already whole: `whole_matrix_muon_step` must then be torch.optim.Muon's step."""

    shards_matrices = True

    def whole(self, p, value):
        return value.clone()

    def part(self, p, whole):
        return whole


def test_whole_matrix_step_is_torch_muons_step_bitwise():
    """The step the sharded layouts run (momentum on the shard, Newton-Schulz on the whole matrix, the update on the
    shard) against torch.optim.Muon on one process: the same bits when the shard is the whole matrix."""
    def run(layout):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**TINY))
        opt = build_optimizer(model, OptimConfig(name="muon", lr_peak=1e-2), layout=layout)
        for seed in (1, 2):
            x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(seed))
            F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    (a, opt_a), (b, opt_b) = run(None), run(WholeOnEveryRank())
    assert opt_a._layout is None and opt_b._layout is not None
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name
    for p, q in zip(a.parameters(), b.parameters()):
        assert opt_a.state[p].keys() == opt_b.state[q].keys()
        assert all(torch.equal(v, opt_b.state[q][k]) for k, v in opt_a.state[p].items())


def test_muon_flag_is_not_zero_redundancy_optimizers_settings_key():
    # ZeroRedundancyOptimizer puts its constructor keywords into every group: MuonWithAdamW's `muon` settings dict
    # is then on AdamW's groups too, and must not send them to Muon.
    assert not is_muon_group({"params": [], "muon": {"lr": 1e-3, "momentum": 0.95}})
    assert is_muon_group({"params": [], "use_muon": True}) and is_muon_group({"params": [], "muon": True})


@pytest.mark.parametrize("overrides", [
    ["strategy=tensor", "trainer.devices=2"],
    ["strategy=fsdp", "trainer.devices=2"],
    ["strategy=zero", "strategy.zero_stage=1", "trainer.devices=2"],
    ["strategy=zero", "strategy.zero_stage=2", "trainer.devices=2"],
])
def test_muon_loads_under_sharded_strategies(overrides):
    c = config.to_object(config.load(EXPERIMENTS / "runs" / "tiny.yaml", ["optim.name=muon", *overrides]))
    assert c.optim.name == "muon"


@pytest.mark.parametrize("overrides, expected", [
    (["model.init=mup"], r"model\.init=mup needs model\.mup_base_width"),
    (["optim.lr_multipliers={embedings: 2}"], r"optim\.lr_multipliers\.embedings: unknown parameter kind"),
])
def test_refused_combinations_name_their_keys(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        config.load(EXPERIMENTS / "runs" / "tiny.yaml", overrides)


def test_module_trains_on_task_plus_z_loss_and_reports_the_task_loss_apart():
    from lit_pretrain.module import PretrainModule

    def module(z_loss):
        return PretrainModule(GPTConfig(**TINY), OptimConfig(z_loss=z_loss), ScheduleConfig(warmup_steps=1),
                              max_steps=2, tokens_per_step=32, seed=0, eod_id=3)

    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(4))
    x[:, 5] = 3  # an end-of-document token: document masking drops the target after it from both losses
    batch = (x[:, :-1], x[:, 1:])
    plain, with_z = module(0.0), module(1e-2)
    task, z = with_z.losses(batch)
    assert plain.losses(batch)[1] is None and torch.equal(task, plain.loss(batch))  # train/loss stays comparable
    with_z.on_train_start()
    trained = with_z.training_step(batch, 0)
    assert z.item() > 0 and torch.equal(trained, task + z) and torch.equal(with_z._z_loss_sum, z.detach())
