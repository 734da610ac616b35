"""The parity matrix: ddp and ZeRO stages 1, 2, 3 on 2 processes (gloo, CPU) against one process, same global batches.

Each run is `python -m lit_pretrain.cli train` in a subprocess, the code path users run (config → Lightning
strategy → our module); Lightning's `ddp` launcher re-runs the command for rank 1, which inside pytest would
re-launch pytest itself (docs/cpu.md, pitfall 2). One run per strategy answers every question:
per-step global losses, gradient norms under active clipping, final weights, optimizer state, per-rank bytes,
and (ZeRO-3) the checkpoint read back into a plain GPT.

Settings that make the runs probe what they must:
- optim.grad_clip_norm=0.1 while the gradient norm is 0.68-0.94 (measured): every step is clipped, so a norm
  taken over one rank's shard only (about 0.7 of the full norm on 2 ranks) would change the update and weights.
- model.vocab_size=513 (the tokenizer has 512): dim 0 of the embedding is odd, so FSDP pads its shards.
- activation checkpointing differs per run (none, full, every_k), showing it composes with each strategy; it
  does not change the math (tests/parallel/test_activation_checkpointing.py checks that bit for bit).
"""

import json
import math

import pytest
import torch

from lit_pretrain.model.gpt import GPT
from lit_pretrain.module import PretrainModule
from lit_pretrain.optim.optimizers import param_groups
from lit_pretrain.parallel.zero import zero_partition
from lit_pretrain.resume.weights import checkpoint_path, load_gpt, load_optimizer_state
from lit_pretrain.runs.folder import read_metrics, series
from tests.conftest import run_module, train_args
from tests.helpers.global_sizes import assert_global_sizes
from tests.helpers.strategies_logits import probe_input

pytestmark = pytest.mark.slow

STEPS = 6
VOCAB = 513
WORLD = 2
COMMON = [f"trainer.max_steps={STEPS}", f"trainer.val_every_n_steps={STEPS}", "trainer.log_every_n_steps=1",
          "schedule.warmup_steps=2", "optim.grad_clip_norm=0.1", f"model.vocab_size={VOCAB}",
          "trainer.progress_bar=false", "strategy.timeout_seconds=60"]
STRATEGIES = {
    "ddp": ["strategy=ddp"],
    "zero1": ["strategy=zero", "strategy.zero_stage=1", "strategy.activation_checkpointing=full"],
    "zero2": ["strategy=zero", "strategy.zero_stage=2", "strategy.activation_checkpointing=every_k",
              "strategy.activation_checkpointing_k=2"],
    "zero3": ["strategy=zero", "strategy.zero_stage=3", "strategy.activation_checkpointing=full"],
}


@pytest.fixture(scope="session")
def runs(tmp_path_factory, tiny_data_dir):
    """Run folders by name, each run started on first use and kept for the session (one per xdist worker: `make test`
    runs the long tests first, tests/helpers/longest_first.py, which takes some of this file's tests from the
    others)."""
    root = tmp_path_factory.mktemp("strategy_runs")
    done = {}

    def get(name):
        if name not in done:
            if name == "single":
                overrides = ["trainer.micro_batch_size=8"]
            else:
                overrides = [*STRATEGIES[name], f"trainer.devices={WORLD}", "trainer.micro_batch_size=4"]
            logits = root / f"{name}.logits.pt"
            callback = ["callbacks.extra=[{class_path: 'tests.helpers.strategies_logits:SaveLogits', "
                        f"init_args: {{out: '{logits}'}}}}]"]
            run_module(*train_args(tiny_data_dir, root, name), *COMMON, *overrides, *callback)
            done[name] = root / name
        return done[name]

    return get


def model_cfg(run_dir):
    from lit_pretrain import config

    return config.to_object(config.load(run_dir / "config.yaml")).model


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_strategy_matches_one_process(runs, name):
    single, other = read_metrics(runs("single") / "metrics.csv"), read_metrics(runs(name) / "metrics.csv")
    # Same windows per step (one global sampler order), same init (run.seed), gradients averaged over the ranks:
    # the runs differ only in float summation order (two 4-sample means averaged vs one 8-sample mean; gradient
    # all-reduce or reduce-scatter; 1 vs 2 threads). Measured on every strategy: losses within 9.5e-7 (2 ulps of
    # fp32 at a loss of 6), gradient norms within 4.2e-7 (ZeRO 2/3; 6e-8 ddp, ZeRO 1); 1e-5 leaves a 10x margin,
    # while another seed moves the per-step loss by 1.3e-3 or more (tests/parallel/test_ddp.py).
    for key, tol in (("train/loss", 1e-5), ("train/grad_norm", 1e-5)):
        a, b = series(single, key), series(other, key)
        assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, STEPS + 1)), key
        for (step, x), (_, y) in zip(a, b):
            assert x == pytest.approx(y, abs=tol), f"{key} at step {step}"
    # Clipping was active at every step, in both runs, so each used the global norm of the whole gradient.
    assert [v for _, v in series(other, "train/clipped")] == [1.0] * STEPS
    assert [v for _, v in series(single, "train/clipped")] == [1.0] * STEPS
    # What tests/parallel/test_ddp.py asserted of its own unclipped pair of runs, which these serve now (the same global
    # batch on 1 and 2 processes; clipped, the gradient norms above also pin the averaging over ranks that AdamW's scale
    # invariance would hide in the losses): it trains, the validation at the last step agrees within the losses'
    # tolerance (same weights within float order, same windows), and the tokens of a step count both ranks.
    loss = series(other, "train/loss")
    assert loss[-1][1] < loss[0][1]
    single_val, other_val = series(single, "val/loss"), series(other, "val/loss")
    assert [s for s, _ in other_val] == [s for s, _ in single_val] == [STEPS]
    assert other_val[-1][1] == pytest.approx(single_val[-1][1], abs=1e-5)
    assert series(other, "train/tokens_seen")[0][1] == WORLD * 4 * 64 == series(single, "train/tokens_seen")[0][1]
    # Final weights: AdamW divides by sqrt(v) + eps, which turns a float-order difference in a tiny gradient
    # entry into a visible one; measured 5.6e-7 on every strategy after 6 steps; 1e-5 is 1% of one step's update
    # (lr 1e-3).
    a, b = load_gpt(runs("single")), load_gpt(runs(name))
    for (key, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(p, q, rtol=0, atol=1e-5), f"{name}: {key} differs by {(p - q).abs().max():.2e}"
    # summary.json's sizes and the logged MFU are the whole model's, as one process counts them.
    assert_global_sizes(runs(name))


@pytest.mark.parametrize("name", ["zero1", "zero3"])
def test_optimizer_state_is_consolidated_into_the_checkpoint(runs, name):
    """The one-file checkpoint holds the whole optimizer state, which loads into a single-process AdamW."""
    ref = load_optimizer_state(runs("single"))
    got = load_optimizer_state(runs(name))
    assert len(got.state) == len(ref.state) == len(list(load_gpt(runs(name)).parameters()))
    for p_ref, p_got in zip((p for g in ref.param_groups for p in g["params"]),
                            (p for g in got.param_groups for p in g["params"])):
        s_ref, s_got = ref.state[p_ref], got.state[p_got]
        assert s_got["step"].item() == s_ref["step"].item() == STEPS
        # Measured within 9.3e-10 (exp_avg) and 3.6e-12 (exp_avg_sq); the bounds are 10x that. The moments
        # themselves reach 2.7e-3 and 9.6e-6 (medians 1.2e-5 and 7e-10): state consolidated into the wrong tensors,
        # or one rank's share only, would be off by about the moments' own size.
        assert torch.allclose(s_got["exp_avg"], s_ref["exp_avg"], rtol=0, atol=1e-8)
        assert torch.allclose(s_got["exp_avg_sq"], s_ref["exp_avg_sq"], rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", ["single", *STRATEGIES])
def test_load_from_checkpoint_under_every_strategy(runs, name):
    """Lightning's PretrainModule.load_from_checkpoint on each run's newest checkpoint (last.ckpt of one process, the
    sharded folder `latest` names on 2, the default format there): the module comes back from the checkpoint's own
    hyperparameters (plain data, read weights-only), unwrapped, with the weights load_gpt reads."""
    run_dir = runs(name)
    path = checkpoint_path(run_dir)
    assert path.name == ("last.ckpt" if name == "single" else f"step{STEPS:07d}")
    module = PretrainModule.load_from_checkpoint(path)
    assert module.model_cfg == model_cfg(run_dir) and module.max_steps == STEPS
    expected = ("zero", int(name[-1])) if name.startswith("zero") else (name, None)
    strategy = module.strategy_cfg
    assert (strategy.name, strategy.zero_stage if strategy.name == "zero" else None) == expected
    reference = load_gpt(run_dir).state_dict()
    got = module.model.state_dict()
    assert list(got) == list(reference)
    for key in reference:
        assert torch.equal(got[key], reference[key]), f"{name}: {key}"


def test_zero3_checkpoint_gives_the_logits_of_the_sharded_model(runs):
    run_dir = runs("zero3")
    sharded_logits = torch.load(run_dir.parent / "zero3.logits.pt", weights_only=True)
    model = load_gpt(run_dir)
    torch.set_num_threads(1)  # as each rank ran: the same kernels on the same weights give the same bits
    with torch.no_grad():
        logits = model(probe_input(VOCAB, model.cfg.seq_len))
    assert torch.equal(logits, sharded_logits)


def shard_rows(dim0: int, rank: int) -> tuple:
    """FSDP2's dim-0 shard of a tensor on `rank`: (rows held, rows padded to). torch.chunk rule: ceil(dim0/world)."""
    per = math.ceil(dim0 / WORLD)
    held = max(0, min(per, dim0 - rank * per))
    return held, per


def test_per_rank_bytes_follow_the_shard_sizes(runs):
    cfg = model_cfg(runs("single"))
    gpt = GPT(cfg)
    shapes = [tuple(p.shape) for p in gpt.parameters()]
    n_tensors, numel = len(shapes), sum(math.prod(s) for s in shapes)
    # One process: fp32 parameters and gradients (4 bytes each), AdamW's two moments (8 bytes) and a fp32 step
    # counter per tensor (4 bytes).
    full = {"param_bytes": 4 * numel, "grad_bytes": 4 * numel, "optimizer_bytes": 8 * numel + 4 * n_tensors}
    table = {"single": [{**full, "gathered_param_bytes": 0}], "ddp": [{**full, "gathered_param_bytes": 0}] * WORLD}

    # ZeRO-1: each tensor's AdamW state lives on the one rank ZeroRedundancyOptimizer assigns it to.
    groups = [[p.numel() for p in g["params"]] for g in param_groups(gpt, 0.1)]
    owned = zero_partition(groups, WORLD)
    table["zero1"] = [{**full, "gathered_param_bytes": 0, "optimizer_bytes": sum(
        8 * groups[g][i] + 4 for g in range(len(groups)) for i in owned[g][r])} for r in range(WORLD)]

    # ZeRO-2/3: every tensor sharded on dim 0. Parameters and gradients live in padded shards (ceil(dim0/world)
    # rows on every rank); AdamW's moments are allocated like the unpadded local shard.
    def rest(s):
        return math.prod(s[1:])

    for name in ("zero2", "zero3"):
        table[name] = []
        for r in range(WORLD):
            padded = sum(4 * shard_rows(s[0], r)[1] * rest(s) for s in shapes)
            held = sum(shard_rows(s[0], r)[0] * rest(s) for s in shapes)
            gathered = sum(4 * shard_rows(s[0], r)[1] * WORLD * rest(s) for s in shapes) if name == "zero2" else 0
            table[name].append({"param_bytes": padded, "grad_bytes": padded,
                                "optimizer_bytes": 8 * held + 4 * n_tensors, "gathered_param_bytes": gathered})

    for name, expected in table.items():
        measured = json.loads((runs(name) / "memory.json").read_text())["ranks"]
        assert [m["rank"] for m in measured] == list(range(len(expected)))
        for m, e in zip(measured, expected):
            assert {k: m[k] for k in e} == e, f"{name} rank {m['rank']}"
    # The claims of the ZeRO table, checked on the measurement: stage 1 splits optimizer state (exactly, summed
    # over ranks), stage 2 also gradients, stage 3 keeps no parameters gathered into backward.
    z1 = json.loads((runs("zero1") / "memory.json").read_text())["ranks"]
    assert sum(r["optimizer_bytes"] for r in z1) == full["optimizer_bytes"]
    z2 = json.loads((runs("zero2") / "memory.json").read_text())["ranks"]
    assert all(r["grad_bytes"] < full["grad_bytes"] * 0.51 for r in z2)


def test_memory_planner_agrees_with_the_measured_bytes(runs):
    """The planner (`lit-pretrain memory --exact`, lit_pretrain/planning/memory.py) against what each rank held.

    Rank 0 holds the first ceil(dim0/world) rows of every tensor, i.e. exactly the padded shard the planner counts,
    so parameters and gradients agree to the byte. The planner leaves out AdamW's fp32 `step` counter (4 bytes per
    tensor, 80 bytes here against ~10^6), which is the whole of the optimizer difference asserted below.
    """
    from lit_pretrain.planning.memory import per_rank_model_state_bytes

    cfg = model_cfg(runs("single"))
    n_tensors = len(list(GPT(cfg).parameters()))
    for name, world, stage in (("single", 1, 0), ("ddp", WORLD, 0), ("zero2", WORLD, 2), ("zero3", WORLD, 3)):
        planned = per_rank_model_state_bytes(cfg, world, stage, "32-true", exact=True)
        rank0 = json.loads((runs(name) / "memory.json").read_text())["ranks"][0]
        if stage == 2:
            # The ZeRO paper's stage 2 keeps parameters replicated; our FSDP2 stage 2 keeps them sharded between
            # steps (the stage-3 shard) and gathers a full, padded copy from forward to the end of backward.
            sharded = per_rank_model_state_bytes(cfg, world, 3, "32-true", exact=True)["param_bytes"]
            assert rank0["param_bytes"] == sharded and rank0["gathered_param_bytes"] == world * sharded
            assert world * sharded - planned["param_bytes"] == 4 * cfg.d_model  # the embedding's one padding row
        else:
            assert rank0["param_bytes"] == planned["param_bytes"], name
        assert rank0["grad_bytes"] == planned["grad_bytes"], name
        assert rank0["optimizer_bytes"] == planned["optimizer_bytes"] + 4 * n_tensors, name
    # ZeRO-1 (ZeroRedundancyOptimizer) gives whole tensors to ranks, so ranks differ; over the ranks it holds the
    # state once, which is the planner's per-rank share times the world size when no tensor needs padding rows.
    planned = per_rank_model_state_bytes(cfg, WORLD, 1, "32-true", exact=False)
    z1 = json.loads((runs("zero1") / "memory.json").read_text())["ranks"]
    assert sum(r["optimizer_bytes"] for r in z1) == planned["optimizer_bytes"] * WORLD + 4 * n_tensors
