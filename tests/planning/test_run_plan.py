"""The shipped GPU run files fit their stated device memory (planning/run_plan.py, what `lit-pretrain memory --run`,
`plan --run`, `show` and `train` use), their token budget is tokens-per-parameter x parameters, and the planner's
bf16-mixed count is what a block saves under autocast."""

import json
import math

import pytest
import torch

from lit_pretrain import config
from lit_pretrain.cli import main
from lit_pretrain.errors import ConfigError
from lit_pretrain.model import shapes
from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT
from lit_pretrain.planning import memory
from lit_pretrain.planning.batch import global_batch
from lit_pretrain.planning.plan import ParallelPlan, build_plan
from lit_pretrain.planning.run_plan import MIN_HEADROOM, format_fit, run_memory
from tests.conftest import EXPERIMENTS

RUNS = EXPERIMENTS / "runs"
SIZED = sorted(p for p in RUNS.glob("*.yaml") if "device_memory_gb" in p.read_text())


def test_the_large_presets_have_run_files_for_one_and_four_nodes_of_h200():
    names = {p.stem for p in SIZED}
    for model in ("llama3_2_1b", "llama3_2_3b", "llama3_1_8b"):
        assert {f"{model}_h200x8", f"{model}_h200x32"} <= names


@pytest.mark.parametrize("run_file", SIZED, ids=lambda p: p.stem)
def test_every_sized_run_file_loads_and_fits_its_device_memory(run_file):
    c = config.to_object(config.load(run_file))  # the load itself refuses a run that does not fit
    r = run_memory(c, c.plan)
    assert r["fits"] and r["headroom_fraction"] >= MIN_HEADROOM
    assert r["total_bytes"] + r["headroom_bytes"] == c.trainer.device_memory_gb * 1e9
    # the comment states what the planner prints, so it cannot drift from it
    stated = f"{r['total_bytes'] / 1e9:.1f} GB of {c.trainer.device_memory_gb:g} GB a GPU, " \
             f"{r['headroom_fraction']:.0%} headroom"
    assert stated in run_file.read_text()
    if c.strategy.context_parallel > 1:  # the 128K stage: compile is refused with context parallelism, and the
        # stage is a number of steps at the rate the 8K run reached (schedule.stage), not a pretraining budget
        assert (c.trainer.precision, c.trainer.compile, c.schedule.stage.kind) == ("bf16-mixed", False, "constant")
        return
    assert (c.trainer.precision, c.trainer.compile, c.schedule.kind) == ("bf16-mixed", True, "wsd")
    # the budget: ceil(tokens_per_param x N / tokens_per_step) steps
    n = shapes.params(c.model)
    assert c.trainer.max_steps == math.ceil(c.trainer.tokens_per_param * n / c.trainer.tokens_per_step)


def test_budget_of_the_8b_run_and_its_refusals():
    run = RUNS / "llama3_1_8b_h200x8.yaml"
    c = config.to_object(config.load(run))
    assert (c.trainer.tokens_per_param, c.trainer.max_steps) == (20, 38_292)  # 20 x 8,030,261,248 / 2^22
    assert c.trainer.max_steps * c.trainer.tokens_per_step >= 20 * 8_030_261_248
    assert config.load(run, ["trainer.tokens_per_param=40"]).trainer.max_steps == 76_583
    assert config.load(run, ["trainer.tokens_per_param=null", "trainer.max_steps=2000"]).trainer.max_steps == 2000
    assert config.load(run, ["trainer.max_steps=38292"]).trainer.max_steps == 38_292  # the same length: no conflict
    with pytest.raises(ConfigError, match="trainer.max_steps=10 in the command line and trainer.tokens_per_param"):
        config.load(run, ["trainer.max_steps=10"])
    with pytest.raises(ConfigError, match="trainer.tokens_per_param=20 .* needs trainer.tokens_per_step"):
        config.load(RUNS / "tiny.yaml", ["trainer.tokens_per_param=20", "trainer.tokens_per_step=null"])
    with pytest.raises(ConfigError, match="trainer.device_memory_gb=141: the run needs 158.4 GB"):
        config.load(run, ["trainer.micro_batch_size=2"])
    # the fix the error names
    fixed = config.load(run, ["trainer.micro_batch_size=2", "strategy.activation_checkpointing=full"])
    assert run_memory(fixed, fixed.plan)["fits"]


def test_the_128k_run_fits_with_the_context_parallel_degree_the_planner_names():
    """131,072-token windows of the 8B on 8 H200 fit with at least 10% free only from context parallelism
    4 (with full activation checkpointing); the planner names that degree, and the file uses it. Without it the
    config is refused when it loads, the error naming strategy.context_parallel=4."""
    run = RUNS / "llama3_1_8b_h200x8_128k.yaml"
    c = config.to_object(config.load(run))
    assert (c.model.seq_len, c.strategy.context_parallel, c.trainer.devices) == (131072, 4, 8)
    m = run_memory(c, c.plan)
    assert m["fits"] and m["headroom_fraction"] >= 0.10 and m["context_parallel_needed"] == 4, m
    assert m["context_parallel"] == 4 and m["context_parallel_bytes"] > 0
    assert "context_parallel needed: 4" in format_fit(m)
    # 4 context-parallel ranks share each window: 2 data-parallel ranks x 16 accumulation = 32 windows of 2^17
    batch = global_batch(c.trainer, c.model.seq_len, build_plan(c))
    assert (batch.data_parallel, batch.accumulation, batch.tokens_per_step) == (2, 16, 2**22)
    with pytest.raises(ConfigError, match="strategy.context_parallel=4: the smallest context-parallel degree"):
        config.load(run, ["strategy.context_parallel=2"])


def test_experts_shard_over_data_parallel_times_context_parallel_ranks_over_expert_parallel():
    """ZeRO-3 x CP 2 x EP 2 on 4 processes: FSDP2 shards each rank's experts over the 4 / 2 = 2 ranks holding the same
    ones (parallel/expert.py: the data-parallel x context-parallel ranks, tests/parallel/test_moe_mesh.py
    zero3_cp2_ep2_moe), so the run's plan is memory_plan's with expert_data_parallel=2, not 1 (data-parallel ranks alone
    / P)."""
    from lit_pretrain.planning.plan import sized_model

    c = config.to_object(config.load(RUNS / "default.yaml", [
        "strategy=zero", "strategy.context_parallel=2", "strategy.expert_parallel=2", "trainer.devices=4",
        "trainer.micro_batch_size=4", "model.moe={num_experts: 8, top_k: 2}"]))
    m, plan = run_memory(c, c.plan), c.plan
    assert (plan.data_parallel_shard, plan.context_parallel, plan.expert_parallel) == (2, 2, 2)

    def direct(replicas):
        layout = ParallelPlan(data_parallel_replicate=replicas, data_parallel_shard=2, context_parallel=2,
                              zero_stage=3, expert_parallel=2)
        return memory.memory_plan(layout, sized_model(c), c.trainer.micro_batch_size, precision=c.trainer.precision)

    # the experts' state is sharded over the ranks holding the same experts: replicas x (shards x context) / P
    assert m["expert_data_parallel"] == direct(1)["expert_data_parallel"] == 2
    assert direct(2)["expert_data_parallel"] == 4
    assert m["total_bytes"] == direct(1)["total_bytes"] > direct(2)["total_bytes"]


def test_zero1_under_context_parallelism_splits_the_optimizer_state_over_shard_times_context_ranks():
    """ZeRO-1 x CP 2 on 4 processes: ZeroRedundancyOptimizer partitions over data_parallel_shard x context_parallel
    (4 ranks), so AdamW's fp32 moments (8 bytes a parameter, twice the 4 of an fp32 weight: Rajbhandari et al. 2020,
    P_os) are 1/4 per rank, weights and gradients whole; the default model's tensors all divide by 4, so the split
    is exact. Without CP, 2 shards hold half each."""
    def states(*overrides):
        c = config.to_object(config.load(RUNS / "default.yaml", ["strategy=zero", "strategy.zero_stage=1",
                                                                 "trainer.micro_batch_size=4", *overrides]))
        m = run_memory(c, c.plan)
        return m["data_parallel"], m["param_bytes"], m["grad_bytes"], m["optimizer_bytes"]

    d, params, grads, optimizer = states("strategy.context_parallel=2", "trainer.devices=4")
    assert (d, grads, optimizer) == (4, params, 2 * params / 4)
    assert states("trainer.devices=2") == (2, params, params, 2 * params / 2)


def test_a_fixed_vocabulary_smaller_than_the_tokenizer_is_refused_by_name():
    from lit_pretrain.train import resolve_vocab

    c = config.to_object(config.load(RUNS / "llama3_2_1b_h200x8.yaml"))
    assert resolve_vocab(c, 8192).model.vocab_size == 128256  # a smaller tokenizer leaves rows unused
    with pytest.raises(ConfigError, match="model.vocab_size=128256 is smaller than the tokenizer's 200000"):
        resolve_vocab(c, 200_000)


def test_memory_and_plan_commands_read_a_run_file(capsys):
    run = str(RUNS / "llama3_1_8b_h200x32.yaml")
    assert main(["memory", "--run", run, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["data_parallel"] == 8 and out["zero_stage"] == 3  # HSDP: shards over a node's 8
    assert out["precision"] == "bf16-mixed-policy" and out["world_size"] == 32  # FSDP2 gathers bf16 weights
    assert main(["memory", "--run", run]) == 0
    assert "headroom" in capsys.readouterr().out.splitlines()[0]
    assert main(["plan", "--run", run, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens_per_param"] == pytest.approx(20, rel=1e-4) and out["memory"]["fits"]
    assert main(["memory", "--run", run, "--layers", "2"]) == 2
    assert "drop --layers" in capsys.readouterr().err
    assert main(["plan", "--params", "1e9", "trainer.max_steps=3"]) == 2
    assert "overrides need --run" in capsys.readouterr().err


def test_autocast_block_count_is_what_a_block_saves_under_bf16_autocast():
    """block_activation_bytes(autocast=True) against the saved-tensor hooks of one block under CPU bf16 autocast:
    exact (fp32 norms, one 16-bit input cast per linear, 16-bit q/k/v/attention output/MLP, fp32 log-sum-exp). The
    meter also sees autocast's cast weights (not leaves): the planner's cast_weight_bytes, 2 bytes a matmul weight."""
    from lit_pretrain.parallel.memory import SavedActivations

    cfg = GPTConfig(vocab_size=64, n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, d_ff=160, seq_len=16)
    torch.manual_seed(0)
    model = GPT(cfg)
    h = model.tok_embeddings(torch.randint(0, 64, (3, 16)))  # (B, T, d): fp32, as the residual stream under autocast
    with SavedActivations(model) as meter, torch.autocast("cpu", dtype=torch.bfloat16):
        model.blocks[0](h, model.rope_cos, model.rope_sin)
    planned = memory.block_activation_bytes(16, 3, 64, 4, 160, bytes_per_element=2, kv_heads=2, autocast=True)
    n = 48  # tokens: fp32 norm region 4·(4Nh + 2N); bf16 5Nh inputs + q, out 2Nh + k, v 2N·32 + 4Nf; fp32 lse 4Na
    assert planned == 4 * (4 * n * 64 + 2 * n) + 2 * (5 * n * 64 + 2 * n * 64 + 2 * n * 32 + 4 * n * 160) + 4 * n * 4
    cast = 2 * (shapes.block_params(cfg) - shapes.block_norm_params(cfg))
    assert meter.bytes == planned + cast
    plan = memory.memory_plan(ParallelPlan(), cfg, 3, precision="bf16-mixed")
    assert plan["activation_bytes_per_layer"] == planned
    assert plan["cast_weight_bytes"] == cast + 2 * 64 * 64  # the blocks' linears and the (tied) head, not the lookup


def test_checkpointing_keeps_the_residual_dtype_and_recomputes_one_block():
    cfg = GPTConfig(vocab_size=1000, n_layers=6, d_model=256, n_heads=4, seq_len=128)
    none = memory.memory_plan(ParallelPlan(), cfg, 2, precision="bf16-mixed")
    full = memory.memory_plan(ParallelPlan(activation_checkpointing="full"), cfg, 2, precision="bf16-mixed")
    # the block input is the fp32 residual stream under autocast: 4 bytes x 128 x 2 x 256
    assert full["activation_bytes_per_layer"] == 4 * 128 * 2 * 256
    assert full["recompute_bytes"] == none["activation_bytes_per_layer"] and none["recompute_bytes"] == 0
    every = memory.memory_plan(ParallelPlan(activation_checkpointing="every_k", activation_checkpointing_k=4),
                               cfg, 2, precision="bf16-mixed")  # blocks 0 and 4 checkpointed, 4 saved whole
    assert every["activation_bytes_per_layer"] * 6 == pytest.approx(
        2 * full["activation_bytes_per_layer"] + 4 * none["activation_bytes_per_layer"])
    true16 = memory.memory_plan(ParallelPlan(activation_checkpointing="full"), cfg, 2, precision="bf16-true")
    assert true16["activation_bytes_per_layer"] == 2 * 128 * 2 * 256


def test_fsdp_transients_gather_the_root_and_two_blocks():
    cfg = GPTConfig(vocab_size=1000, n_layers=4, d_model=64, n_heads=4, seq_len=32, tie_embeddings=False)
    block, tokens = shapes.block_params(cfg), 32 * 2
    logits_grad = 4 * tokens * 1000 + 2 * tokens * 1000  # fp32 gradient and its bf16 cast
    one = memory.memory_plan(ParallelPlan(), cfg, 2, precision="bf16-mixed")
    assert one["transient_bytes"] == logits_grad  # one process: nothing gathered
    z3 = memory.memory_plan(ParallelPlan(data_parallel_shard=8, zero_stage=3), cfg, 2, precision="bf16-mixed")
    root = 2 * 1000 * 64 + 64  # embedding, untied head, final norm
    assert z3["transient_bytes"] == logits_grad + 4 * (root + 2 * block) + 4 * (block + 1000 * 64)
    z2 = memory.memory_plan(ParallelPlan(data_parallel_shard=8, zero_stage=2), cfg, 2, precision="bf16-mixed")
    assert z2["transient_bytes"] == logits_grad + 4 * (block + 1000 * 64)  # parameters stay gathered: states
    assert z3["total_bytes"] == (z3["model_state_bytes"] + z3["cast_weight_bytes"] + z3["activation_bytes"]
                                 + z3["transient_bytes"])


def test_memory_and_plan_state_every_size_in_gb(capsys):
    """One unit in `memory` and `plan`: GB (1e9 bytes), that of trainer.device_memory_gb (the table said GiB beside
    the line's GB: 106.063 GiB under 113.9 GB for the same total)."""
    run = str(RUNS / "llama3_1_8b_h200x8.yaml")
    shape = ["--layers", "2", "--hidden", "64", "--heads", "4", "--device-memory", "80GiB"]
    outputs = []
    for argv in (["memory", "--run", run], ["plan", "--run", run], ["memory", *shape]):
        assert main(argv) == 0
        outputs.append(capsys.readouterr().out)
    for out in outputs:
        assert " GB" in out and "GiB" not in out and "MiB" not in out
    loaded = config.load(run)
    total = run_memory(loaded, loaded.plan)["total_bytes"]
    assert f"{total / 1e9:.1f} GB per device" in outputs[0] and f"{total / 1e9:.3f} GB" in outputs[0]
    assert f"{total / 1e9:.1f} GB per device" in outputs[1]
    assert "fits in 85.9 GB: yes" in outputs[2]  # 80 GiB given = 85.9 GB stated
