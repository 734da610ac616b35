"""trainer.compile (parallel/compile.py): the compiled forward and loss compute what eager does, as one graph on one
process and block by block with activation checkpointing and through the strategies' wrapping; a clear error when
the C++ toolchain inductor needs is missing; and what "auto" decides."""

import pytest
import torch

from lit_pretrain.errors import ConfigError
from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT
from lit_pretrain.model.losses import lm_losses
from lit_pretrain.parallel.activation_checkpointing import is_checkpointed
from lit_pretrain.parallel.apply import apply_plan
from lit_pretrain.parallel.compile import check_toolchain, compile_blocks, compiler_available, is_compiled
from lit_pretrain.planning.compile_policy import AUTO_MIN_FLOPS, decide
from lit_pretrain.planning.plan import DEGREE_KEYS, ParallelPlan, build_plan, compile_decision, sized_model

needs_compiler = pytest.mark.skipif(not compiler_available(), reason="torch.compile on CPU needs a C++ compiler")

B, T = 2, 16
# Inductor fuses RMSNorm, RoPE, SiLU·up, the attention softmax and the cross-entropy into generated C++ loops whose
# fp32 reductions run in another order than ATen's: each reordered sum differs by a few ulps (~1e-7 relative),
# amplified through 2 blocks and the backward to ~1e-6 on values of order 1 (measured: loss 5e-7, gradients 3e-6).
# 1e-5 absolute (gradients are 1e-3..1e-1 here) leaves a margin of about 3 yet fails on any real error (a wrong
# mask, a dropped term: differences of order 1e-2).
ATOL = 1e-5
Z_LOSS = 1e-2  # large enough that a z-loss dropped or doubled in the compiled graph moves the sum by > 1e-2


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, n_layers=2, d_model=32, n_heads=4, seq_len=T))


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 128, (B, T), generator=g), torch.randint(0, 128, (B, T), generator=g)


def eager_losses(model, x, y, document_ids=None, z_loss=0.0):
    return lm_losses(model(x), y, z_loss)


class Step(torch.nn.Module):
    """The training step's loss as a module, so DDP can wrap it as Lightning's DDP wraps the LightningModule (whose
    training step calls the compiled forward and loss of the GPT inside)."""

    def __init__(self, model, forward_losses, z_loss=0.0):
        super().__init__()
        self.model, self.forward_losses, self.z_loss = model, forward_losses, z_loss

    def forward(self, x, y):
        task, z = self.forward_losses(x, y, None, self.z_loss)
        return task if z is None else task + z


def loss_and_grads(step: torch.nn.Module, params_of: torch.nn.Module):
    loss = step(*batch())
    loss.backward()
    grads = {name.replace("_checkpoint_wrapped_module.", "").removeprefix("module."): p.grad
             for name, p in params_of.named_parameters()}
    return loss.detach(), grads


def assert_same(eager, compiled):
    (loss_e, grads_e), (loss_c, grads_c) = eager, compiled
    assert torch.allclose(loss_c, loss_e, atol=ATOL, rtol=0)
    assert grads_c.keys() == grads_e.keys()
    for name in grads_e:
        assert torch.allclose(grads_c[name], grads_e[name], atol=ATOL, rtol=0), name


@needs_compiler
@pytest.mark.parametrize("activation_checkpointing", ["none", "full", "selective"])
def test_compiled_step_matches_eager(activation_checkpointing):
    """Through `apply_plan`, as the module applies it. One process: the whole forward and the loss (z-loss
    included) as one graph, blocks untouched. With checkpointing: each block compiled inside its wrapper (regional),
    and the loss apart. Under torch.no_grad the eager forward runs (no forward-only graph is compiled)."""
    eager, compiled = gpt(), gpt()
    apply_plan(eager, ParallelPlan(activation_checkpointing=activation_checkpointing))
    par = apply_plan(compiled, ParallelPlan(activation_checkpointing=activation_checkpointing, compile=True))
    regional = activation_checkpointing != "none"
    assert all(is_compiled(b) == regional for b in compiled.blocks) and not any(is_compiled(b) for b in eager.blocks)
    assert all(is_checkpointed(b) for b in compiled.blocks) == regional
    z_loss = 0.0 if regional else Z_LOSS
    assert_same(loss_and_grads(Step(eager, lambda *a: eager_losses(eager, *a), z_loss), eager),
                loss_and_grads(Step(compiled, par.forward_losses, z_loss), compiled))
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.no_grad():
        assert torch.equal(par.forward_losses(*batch())[0], eager_losses(eager, *batch())[0])  # eager: bit for bit
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
    # Compiling again is a no-op (Lightning may call configure_model twice), and names are the plain GPT's.
    assert apply_plan(compiled, ParallelPlan(compile=True)) is par
    assert not regional or compile_blocks(compiled) == 0
    assert compiled.state_dict().keys() == gpt().state_dict().keys()


@needs_compiler
def test_compiled_step_under_ddp_and_zero3(tmp_path):
    """The strategies' wrapping around the compiled step: DDP (strategy ddp, and ZeRO stage 1's DDP) wraps the
    module whose step calls the compiled forward and loss; FSDP2 (ZeRO stage 3) shards each compiled block, its hooks
    outside the graph (regional compile: the loss compiled apart, on the logits the sharded root's forward returns).
    One rank is enough to run the wrapping code paths and their hooks (the reductions are identities); the
    multi-rank math of each strategy is tested eagerly in test_strategies_parity.py. In this process, not a
    spawned one, so the graphs compiled above are reused instead of compiled again (~30 s)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        # The z-losses of the graphs compiled above (a new one would compile again).
        model = gpt()
        eager = loss_and_grads(Step(model, lambda *a: eager_losses(model, *a), Z_LOSS), model)
        ddp = gpt()
        par = apply_plan(ddp, ParallelPlan(compile=True))
        step = DistributedDataParallel(Step(ddp, par.forward_losses, Z_LOSS))
        assert_same(eager, loss_and_grads(step, ddp))

        model = gpt()
        eager = loss_and_grads(Step(model, lambda *a: eager_losses(model, *a)), model)
        zero3 = gpt()
        par = apply_plan(zero3, ParallelPlan(zero_stage=3, compile=True), fsdp_mesh=init_device_mesh("cpu", (1,)))
        assert isinstance(zero3.blocks[0], FSDPModule) and is_compiled(zero3.blocks[0])
        loss, grads = loss_and_grads(Step(zero3, par.forward_losses), zero3)
        assert_same(eager, (loss, {k: g.full_tensor() for k, g in grads.items()}))
    finally:
        dist.destroy_process_group()


def test_missing_compiler_is_a_config_error(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(ConfigError, match=r"trainer\.compile"):
        check_toolchain()


def test_missing_compiler_stops_apply_plan_before_compiling(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    model = gpt()
    with pytest.raises(ConfigError, match=r"trainer\.compile=false"):
        apply_plan(model, ParallelPlan(compile=True))
    assert not any(is_compiled(b) for b in model.blocks)


NO_CXX = "no C++ compiler was found"
BIG, SMALL = AUTO_MIN_FLOPS, AUTO_MIN_FLOPS * 0.99


@pytest.mark.parametrize("setting, flops, degrees, missing, expected, words", [
    (True, 1.0, (1, 1), NO_CXX, True, "trainer.compile=true asks for it"),  # check_toolchain stops it where applied
    (False, 1e30, (1, 1), None, False, "trainer.compile=false asks for eager steps"),
    ("auto", BIG, (1, 1), None, True, "a C++ compiler was found and this run's 9.9e+12 training FLOPs a process "
                                      "pay back the ~20 s a first compile takes (from 9.9e+12, trainer.compile=auto); "
                                      "set trainer.compile=false to run eager"),
    ("auto", SMALL, (1, 1), None, False, "this run's 9.8e+12 training FLOPs a process are under the 9.9e+12 that pay "
                                         "back the ~20 s a first compile takes (trainer.compile=auto); set "
                                         "trainer.compile=true to compile anyway"),
    ("auto", None, (1, 1), None, False, "cannot weigh the run without the model's size"),
    ("auto", 1e30, (1, 1), NO_CXX, False, f"{NO_CXX}, which inductor needs to build its kernels; install it to let "
                                          "trainer.compile=auto compile"),
    ("auto", 1e30, (1, 1), "Python's headers are missing", False, "Python's headers"),
    # trainer.compile=true is refused with them (plan.check_plan): the line offers no way to force it
    ("auto", 1e30, (2, 1), None, False, "tensor parallelism is on (strategy.tensor_parallel=2): our tensor-parallel "
                                        "layers call collectives inside each block, which a full-graph compile cannot "
                                        "trace"),
    ("auto", 1e30, (1, 2), None, False, "pipeline parallelism is on (strategy.pipeline_parallel=2)"),
])
def test_auto_compiles_where_the_toolchain_the_plan_and_the_run_size_allow(setting, flops, degrees, missing,
                                                                           expected, words):
    decision = decide(setting, flops, *degrees, missing=missing)
    assert decision.compile is expected and words in decision.note()
    # what it decided, then why, in words (not "auto: ..."), and how to decide otherwise where that is allowed
    assert decision.note().startswith(f"torch.compile: {'on' if expected else 'off'} — ")
    assert ("set trainer.compile" in decision.note()) == (setting == "auto" and max(degrees) == 1 and missing is None)


def test_a_start_refused_by_a_config_error_prints_no_compile_line(tmp_path, tiny_data_dir, capsys):
    """The compile decision is printed just before training: a start that a check refuses (here the model's
    vocabulary against the tokenizer's, checked once the data is verified) says only why it was refused."""
    from lit_pretrain import config
    from lit_pretrain.train import train
    from tests.conftest import EXPERIMENTS, tiny_data_overrides

    cfg = config.load(EXPERIMENTS / "runs" / "tiny.yaml", [*tiny_data_overrides(tiny_data_dir),
                                                          f"run.root_dir={tmp_path}", "model.vocab_size=256"])
    with pytest.raises(ConfigError, match="model.vocab_size=256 is smaller than the tokenizer's 512"):
        train(cfg)
    out = capsys.readouterr().out
    assert "compile" not in out and out.strip(), out  # the data lines came; the compile line did not
    assert not (tmp_path / "tiny").exists()


def test_auto_weighs_each_process_s_training_flops():
    """The default run (200 steps of 2,048 tokens, 35.0 MFLOPs a token) compiles; the tiny runs the tests train
    through `train`, the ablations and the CPU sweep's runs stay eager; a data-parallel process counts its share."""
    from lit_pretrain import config
    from tests.conftest import EXPERIMENTS

    def flops(run, *overrides):
        c = config.to_object(config.load(EXPERIMENTS / "runs" / run, list(overrides)))
        plan = build_plan(c)
        degrees = {k: getattr(plan, k) for k in DEGREE_KEYS}
        assert c.trainer.compile == "auto"
        return compile_decision(c.trainer, sized_model(c), degrees, missing=None)

    default = flops("default.yaml")
    assert default.compile and "1.4e+13 training FLOPs a process" in default.reason
    assert not flops("tiny.yaml").compile and not flops("tiny.yaml", "trainer.max_steps=1000").compile
    assert not flops("default.yaml", "trainer.max_steps=100").compile
    # ZeRO-3 over 2 processes: each computes half of a global batch of 4,096 tokens, the default's FLOPs again.
    assert flops("default.yaml", "strategy=zero", "trainer.devices=2", "trainer.tokens_per_step=4096").compile
    assert not flops("default.yaml", "strategy=zero", "trainer.devices=4", "trainer.micro_batch_size=4",
                     "trainer.tokens_per_step=4096").compile
    # bf16-mixed decides alike (compile_policy.py: its faster eager step and compile's larger saving cancel): the
    # default run compiles on one process, under DDP and under ZeRO; the tiny runs stay eager.
    bf16 = "trainer.precision=bf16-mixed"
    assert flops("default.yaml", bf16).compile and not flops("tiny.yaml", bf16).compile
    for strategy in ("strategy=ddp", "strategy=zero"):
        assert flops("default.yaml", bf16, strategy, "trainer.devices=2", "trainer.tokens_per_step=4096").compile
