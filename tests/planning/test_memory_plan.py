"""Per-device memory planner: table tests against the ZeRO and activation-recomputation papers, and the bytes that
PyTorch really holds for our model's parameters, gradients and AdamW states in one process."""

import math
from dataclasses import asdict

import pytest
import torch

from lit_pretrain.errors import ConfigError
from lit_pretrain.model import shapes
from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT
from lit_pretrain.optim.optimizers import build_adamw
from lit_pretrain.planning import memory
from lit_pretrain.planning.plan import ParallelPlan
from lit_pretrain.schema import OptimConfig


@pytest.mark.parametrize("stage, gigabytes", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_table1_row_7_5b_params_64_gpus(stage, gigabytes):
    # Rajbhandari et al. 2019, Figure 1 / Table 1: Ψ = 7.5B, N_d = 64, K = 12: baseline 120 GB, P_os 31.4 GB,
    # P_os+g 16.6 GB, P_os+g+p 1.88 GB (GB = 1e9 bytes; compared at the paper's printed precision).
    got = memory.model_state_bytes(7.5e9, data_parallel=64, zero_stage=stage)["model_state_bytes"] / 1e9
    assert round(got, 1) == gigabytes


def test_zero_stage_formulas():
    # (2 + 2 + K)Ψ; stage 1: 4Ψ + KΨ/N_d; stage 2: 2Ψ + (2 + K)Ψ/N_d; stage 3: (2 + 2 + K)Ψ/N_d (ZeRO §5.1-5.3)
    psi, nd = 1e9, 8
    assert memory.model_state_bytes(psi, nd, 1)["model_state_bytes"] == 4 * psi + 12 * psi / nd
    assert memory.model_state_bytes(psi, nd, 2)["model_state_bytes"] == 2 * psi + 14 * psi / nd
    assert memory.model_state_bytes(psi, nd, 3)["model_state_bytes"] == 16 * psi / nd


def test_korthikanti_table2_rows():
    # Korthikanti et al. 2022, Table 2, per-layer activation bytes. GPT-3 175B: a 96, s 2048, h 12288 (their Table 3).
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    per_layer = memory.activation_bytes_per_layer
    assert per_layer(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert per_layer(s, b, h, a, t) == sbh * (10 + 24 / t + 5 * a * s / (h * t))
    assert per_layer(s, b, h, a, t, sequence_parallel=True) == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)))
    assert per_layer(s, b, h, a, t, activation_checkpointing="selective") == sbh * (10 + 24 / t)
    assert per_layer(s, b, h, a, t, True, "selective") == pytest.approx(sbh * 34 / t)
    assert per_layer(s, b, h, a, t, True, "full") == 2 * sbh
    # §4.2: for GPT-3, 5as/h = 80, so selective recomputation drops 80 / (34 + 80) = 70% of a layer's activations
    assert 5 * a * s / h == 80
    assert 1 - per_layer(s, b, h, a, activation_checkpointing="selective") / per_layer(s, b, h, a) == pytest.approx(
        80 / 114)
    # the abstract's "5x": tensor-parallel baseline against sequence parallelism + selective recomputation
    assert per_layer(s, b, h, a, t) / per_layer(s, b, h, a, t, True, "selective") == pytest.approx(23 / 4.25)


def test_first_pipeline_stage_holds_all_layers_worth_of_activations():
    cfg = GPTConfig(vocab_size=32000, n_layers=8, d_model=1024, n_heads=16, seq_len=2048)
    one = memory.memory_plan(ParallelPlan(), cfg, 1)
    four = memory.memory_plan(ParallelPlan(pipeline_parallel=4), cfg, 1)
    # 1F1B: p micro-batches of L/p layers in flight on the first stage (Korthikanti et al. §4.2.3)
    assert four["activation_bytes"] == one["activation_bytes"] - one["logits_bytes"]
    assert four["layers_per_stage"] == 2
    assert four["params_per_device"] == 2 * shapes.block_params(cfg) + 32000 * 1024


def test_tensor_parallel_splits_matrices_not_norms():
    cfg = GPTConfig(vocab_size=1000, n_layers=2, d_model=128, n_heads=4, seq_len=64)
    one, two = memory.memory_plan(ParallelPlan(), cfg, 1), memory.memory_plan(ParallelPlan(tensor_parallel=2), cfg, 1)
    norms = 2 * 2 * 128 + 128
    assert two["params_per_device"] == (one["params_per_device"] - norms) / 2 + norms
    with pytest.raises(ConfigError, match="must divide --heads"):
        memory.memory_plan(ParallelPlan(tensor_parallel=3), cfg, 1)
    # The embedding and head are split along the vocabulary (parallel/vocab.py): V must divide by t, as in train.
    with pytest.raises(ConfigError, match="must divide --vocab 1001"):
        memory.memory_plan(ParallelPlan(tensor_parallel=2), GPTConfig(**{**asdict(cfg), "vocab_size": 1001}), 1)


def test_exact_shards_pad_dim0_like_fsdp2():
    # vocab 513 and d 48 over 4 ranks: the embedding's 513 rows become 4 shards of 129 (3 rows of padding)
    cfg = GPTConfig(vocab_size=513, n_layers=1, d_model=48, n_heads=2, seq_len=16)
    exact = memory.per_rank_model_state_bytes(cfg, 4, zero_stage=3, precision="32-true")
    elements = sum(math.ceil(s[0] / 4) * math.prod(s[1:]) for s in shapes.param_shapes(cfg).values())
    assert exact["param_bytes"] == 4 * elements and exact["optimizer_bytes"] == 8 * elements
    others = sum(math.ceil(s[0] / 4) * math.prod(s[1:]) for n, s in shapes.param_shapes(cfg).items()
                 if n != "tok_embeddings.weight")
    assert elements == 129 * 48 + others
    approx = memory.per_rank_model_state_bytes(cfg, 4, zero_stage=3, precision="32-true", exact=False)
    assert exact["param_bytes"] > approx["param_bytes"]
    stage1 = memory.per_rank_model_state_bytes(cfg, 4, zero_stage=1, precision="32-true")
    assert stage1["param_bytes"] == 4 * shapes.params(cfg) and stage1["optimizer_bytes"] == 8 * elements


@pytest.mark.parametrize("precision, dtype", [("32-true", torch.float32), ("bf16-true", torch.bfloat16)])
def test_planner_matches_what_adamw_holds_in_one_process(precision, dtype):
    cfg = GPTConfig(vocab_size=256, n_layers=2, d_model=64, n_heads=4, seq_len=16)
    torch.manual_seed(0)
    model = GPT(cfg).to(dtype)
    opt = build_adamw(model, OptimConfig())
    model(torch.randint(0, 256, (2, 16))).float().logsumexp(-1).mean().backward()
    opt.step()
    held = {
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "grad_bytes": sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()),
        "optimizer_bytes": sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items()
                               if k in ("exp_avg", "exp_avg_sq")),
    }
    planned = memory.per_rank_model_state_bytes(cfg, 1, zero_stage=0, precision=precision)
    assert {k: planned[k] for k in held} == held


def test_fits_and_bad_inputs():
    cfg = GPTConfig(vocab_size=1000, n_layers=2, d_model=64, n_heads=4, seq_len=64)
    plan = memory.memory_plan(ParallelPlan(), cfg, 4, precision="32-true", device_memory=memory.parse_bytes("1MB"))
    assert plan["fits"] is False and plan["total_bytes"] > 1e6
    assert memory.parse_bytes("80GiB") == 80 * 2**30 and memory.parse_bytes("80GB") == 8e10
    with pytest.raises(ConfigError, match="--device-memory"):
        memory.parse_bytes("lots")
    with pytest.raises(ConfigError, match="--precision"):
        memory.memory_plan(ParallelPlan(), cfg, 1, precision="fp8")
    with pytest.raises(ConfigError, match="--zero-stage"):
        memory.memory_plan(ParallelPlan(zero_stage=4), cfg, 1)
    with pytest.raises(ConfigError, match="--sequence-parallel"):
        memory.memory_plan(ParallelPlan(sequence_parallel=True), cfg, 1)
    with pytest.raises(ConfigError, match="--exact"):
        memory.memory_plan(ParallelPlan(tensor_parallel=2), cfg, 1, exact=True)


def test_our_block_activation_count_matches_the_saved_tensor_hooks_in_one_process():
    """block_activation_bytes against parallel/memory.py's SavedActivations on one block, fp32 CPU, t = 1: the
    count is exact. (TP 2 with and without sequence parallelism: tests/parallel/test_mesh_parallel.py, 2 processes.)"""
    from lit_pretrain.parallel.memory import SavedActivations

    cfg = GPTConfig(vocab_size=64, n_layers=1, d_model=32, n_heads=4, d_ff=96, seq_len=16)
    torch.manual_seed(0)
    model = GPT(cfg)
    h = model.tok_embeddings(torch.randint(0, 64, (3, 16)))  # (B, T, d): the block's input, not a leaf
    with SavedActivations(model) as meter:
        model.blocks[0](h, model.rope_cos, model.rope_sin)
    planned = memory.block_activation_bytes(16, 3, 32, 4, 96)
    # N = 48 tokens: fp32 (10·N·h + 2·N + 4·N·f) + fp32 log-sum-exp N·a
    assert planned == 4 * (10 * 48 * 32 + 2 * 48 + 4 * 48 * 96) + 4 * 48 * 4
    assert meter.bytes == planned


def test_block_activation_bytes_under_tensor_and_sequence_parallelism():
    n, h, f, a, t = 4096, 1024, 2816, 16, 4
    tp = memory.block_activation_bytes(n, 1, h, a, f, t, bytes_per_element=2)
    sp = memory.block_activation_bytes(n, 1, h, a, f, t, sequence_parallel=True, bytes_per_element=2)
    # Only the norm region (x, x̂ of both norms, 4nh, and their rsqrt, 2n) is divided by t in addition.
    assert tp - sp == pytest.approx(2 * (4 * n * h + 2 * n) * (1 - 1 / t))
    assert sp == pytest.approx(2 * ((4 * n * h + 2 * n) / t + 2 * n * h + (4 * n * h + 4 * n * f) / t) + 4 * n * a / t)
    cfg = GPTConfig(vocab_size=1000, n_layers=2, d_model=h, n_heads=a, d_ff=f, seq_len=n)
    plan = memory.memory_plan(ParallelPlan(tensor_parallel=t, sequence_parallel=True), cfg, 1, precision="bf16-true")
    assert plan["activation_bytes_per_layer"] == sp
    with pytest.raises(ConfigError, match="--sequence-parallel"):
        memory.block_activation_bytes(n, 1, h, a, f, 1, sequence_parallel=True)
