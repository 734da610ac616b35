"""The performance benchmark's pure parts: MFU (PaLM appendix B), the GPU models' sizes, the GPU bench's error
without CUDA, and the table's cases built from measured figures."""

import json
from types import SimpleNamespace

import pytest
import torch

from lit_pretrain.bench import child
from lit_pretrain.bench.step import gpu, mfu, profile_step
from lit_pretrain.model.gpt import GPT, flops_per_token_formula
from tests.conftest import EXPERIMENTS

# PaLM (Chowdhery et al. 2022), §4 and appendix B: PaLM 540B (N = 540.35e9, L = 118, H = 48, Q = 256,
# T = 2048) trained at 238.3K tokens/s on 6144 TPU v4 chips of 275 TFLOP/s bf16 peak each: 46.2% MFU (Table 3).
# Its FLOPs per token are 6N + 12LHQT = 3.242e12 + 3.56e10 (attention is ~1% at this width).
PALM_540B_FLOPS_PER_TOKEN = flops_per_token_formula(540_350_000_000, 118, 48, 256, 2048)


@pytest.mark.parametrize("tokens_per_s, flops_per_token, peak, expected, tol", [
    (238.3e3, PALM_540B_FLOPS_PER_TOKEN, 6144 * 275e12, 0.462, 5e-4),  # PaLM Table 3 (rounded to 0.1%)
    (1000.0, 6e6, 12e9, 0.5, 1e-12),  # exact: 1000 tokens/s × 6 MFLOP = 6 GFLOP/s on a 12 GFLOP/s peak
    (0.0, 6e6, 12e9, 0.0, 0.0),
])
def test_mfu_palm_appendix_b(tokens_per_s, flops_per_token, peak, expected, tol):
    assert mfu.mfu(tokens_per_s, flops_per_token, peak) == pytest.approx(expected, abs=tol)


def test_mfu_refuses_a_non_positive_peak():
    with pytest.raises(ValueError, match="peak"):
        mfu.mfu(1.0, 1.0, 0.0)


def test_mfu_cases_carry_ratio_and_goal():
    cases = mfu.cases({"eager": 1000.0, "compiled": 1200.0}, 6_000_000, 12e9, {"compiled": ">= 0.7"})
    assert [c["case"] for c in cases] == ["mfu_eager", "mfu_compiled"]
    assert [c["ratio"] for c in cases] == pytest.approx([0.5, 0.6])
    assert [c["value"] for c in cases] == pytest.approx([6.0, 7.2])  # GFLOP/s
    assert [c["goal"] for c in cases] == ["-", ">= 0.7"]
    assert all("spread" not in c for c in cases)  # one figure each: no spread to report


def test_mfu_cases_of_a_series_report_median_and_spread():
    # 1000, 1500 and 1200 tokens/s x 6 MFLOP/token over a 12 GFLOP/s peak: MFUs 0.5, 0.75, 0.6.
    (case,) = mfu.cases({"compiled": [1000.0, 1500.0, 1200.0]}, 6_000_000, 12e9, {})
    assert case["ratio"] == pytest.approx(0.6) and case["spread"] == pytest.approx(0.25)
    assert case["value"] == pytest.approx(7.2) and case["alternations"] == 3


@pytest.mark.parametrize("name, low, high", [("125m", 100e6, 150e6), ("1b", 0.9e9, 1.1e9)])
def test_gpu_models_have_their_nominal_sizes(name, low, high):
    cfg, micro_batch_size = gpu.model_config(name)
    with torch.device("meta"):  # sizes only: no memory for a billion parameters
        model = GPT(cfg)
    assert low <= model.num_params(non_embedding=False) <= high
    assert micro_batch_size >= 1


def test_gpu_bench_without_cuda_says_what_to_do(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="make bench-gpu needs a CUDA GPU.*make bench"):
        gpu.require_cuda()
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        gpu.main([])


def test_a_childs_series_are_summarized_by_paired_case_in_their_order(monkeypatch):
    """bench/child.py: the data cases time in a torch-free child; its paired series come back and go through
    paired_case (the statistics of every other case), replayed in measured order; other cases pass through."""
    printed = [child.series("c", [1.0, 2.0, 4.0], [2.0, 4.0, 8.0], ">= 2", "docs/s", ("ref", "ours"), {"n": 3}),
               {"case": "memory", "value": 1.0, "reference": 2.0, "ratio": 0.5}]

    def fake_run(command, **_):
        assert command[1:] == ["-m", "lit_pretrain.bench.data.deduplication", "x"]
        return SimpleNamespace(returncode=0, stdout="a log line\n" + json.dumps(printed) + "\n", stderr="")

    monkeypatch.setattr(child.subprocess, "run", fake_run)
    paired, passed = child.run("lit_pretrain.bench.data.deduplication", "x")
    assert paired["case"] == "c" and paired["ratio"] == pytest.approx(2.0) and paired["goal"] == ">= 2"
    assert paired["detail"] == {"ref": [1.0, 2.0, 4.0], "ours": [2.0, 4.0, 8.0], "n": 3}
    assert passed == printed[1]


@pytest.mark.parametrize("name, kind", [
    ("aten::mm", "matmul"), ("aten::addmm", "matmul"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
    ("graph_0_cpp_fused__log_softmax_nll_loss_forward_view_6", "compiled kernels"),  # inductor's kernel profile
    ("aten::_fused_adamw_", "optimizer"), ("aten::_foreach_mul_", "optimizer"),
    ("aten::copy_", "other"), ("## Call CompiledFxGraph abc ##", "other"),
])
def test_profile_step_sorts_operators_by_kind(name, kind):
    assert profile_step.kind_of(name) == kind


def test_profile_step_counts_every_matmul_flop_of_the_step():
    """The eager step of a tiny model: the profiler's matmul FLOPs are exactly 6 x tokens x the weights of every
    nn.Linear (forward 2, backward 4: the input's and the weight's gradients; the first block's input needs its
    gradient for the embedding), so no matmul is missed or counted in another kind."""
    from lit_pretrain import config

    c = config.to_object(config.load(EXPERIMENTS / "runs" / "tiny.yaml", ["model.vocab_size=512"]))
    rows = profile_step.profile(c, steps=1, warmup=1, compile=False)
    linear_weights = sum(m.weight.numel() for m in GPT(c.model).modules() if isinstance(m, torch.nn.Linear))
    tokens = c.trainer.micro_batch_size * c.model.seq_len
    assert rows["matmul"]["flops"] == 6 * tokens * linear_weights
    assert rows["matmul"]["seconds"] > 0 and rows["attention"]["seconds"] > 0


def test_precision_case_alternates_bf16_mixed_with_fp32_and_gives_each_mfu_its_own_dtype_peak(monkeypatch):
    """bench/step/precision.py on the tiny run (eager: auto leaves it uncompiled, as its run would be), one alternation:
    the ratio is bf16-mixed's tokens/s over fp32's, and each MFU divides by the peak of its own dtype."""
    from lit_pretrain import config
    from lit_pretrain.bench.step import precision

    # The peak's matmuls at 256², not 2048²: the assertions are the case's arithmetic, whatever the peak's size. On
    # a CPU without bf16 units (AVX2 only) one emulated bf16 2048² matmul takes ~20 s and the peak times six of them
    # (the whole test: 345 s there, under 1 s at 256²); the peak's label follows the size (mfu.peak_label).
    monkeypatch.setattr(mfu, "PEAK_MATMUL_N", 256)
    c = config.to_object(config.load(EXPERIMENTS / "runs" / "tiny.yaml", ["model.vocab_size=512"]))
    case, bf16, fp32 = precision.run(c, steps=3, skip=1, repeats=1)
    assert [case["case"], bf16["case"], fp32["case"]] == ["bf16_mixed_step_tokens_per_s", "mfu_bf16_mixed",
                                                          "mfu_32_true"]
    d = case["detail"]
    assert d["compiled"] is False and case["alternations"] == 1 and case["goal"] == ">= 1.5"
    assert case["ratio"] == pytest.approx(d["bf16_mixed"][0] / d["fp32"][0])
    flops_per_token = GPT(c.model).flops_per_token()
    for m, tokens_per_s, dtype in ((bf16, d["bf16_mixed"][0], "bf16"), (fp32, d["fp32"][0], "fp32")):
        peak = max(m["detail"]["peak_samples_gflops"]) * 1e9
        assert m["ratio"] == pytest.approx(tokens_per_s * flops_per_token / peak)
        assert m["detail"]["peak"] == mfu.peak_label(dtype)
    assert d["matmul_peak_ratio"] == pytest.approx(bf16["reference"] / fp32["reference"])


def test_sharded_checkpoint_cases_from_one_repeat_leave_the_spread_out():
    """`--cases checkpoint --repeats 1` gives one save and one load per format: no spread (bench/stats.py), which the
    load's detail read unconditionally (a KeyError)."""
    from lit_pretrain.bench.checkpoint import sharded_checkpoint

    single = {"s": [2.0], "load_s": [1.0], "stall_s": [], "peak": 800}
    shard = {"s": [1.0], "load_s": [0.5], "stall_s": [0.1], "peak": 400}
    cases = sharded_checkpoint.cases(single, shard, 2, 1)
    assert [c["case"] for c in cases] == ["checkpoint_sharded_rank0_peak_bytes", "checkpoint_sharded_save_seconds",
                                          "checkpoint_async_stall_seconds"]
    assert [c["ratio"] for c in cases] == pytest.approx([0.5, 0.5, 0.1])
    assert cases[0]["detail"]["load_ratio"] == pytest.approx(0.5) and "load_ratio_spread" not in cases[0]["detail"]
    assert all("spread" not in c for c in cases)
    two = sharded_checkpoint.cases({**single, "s": [2.0, 2.0], "load_s": [1.0, 2.0]},
                                   {**shard, "s": [1.0, 1.0], "load_s": [0.5, 0.5], "stall_s": [0.1, 0.2]}, 2, 2)
    assert two[0]["detail"]["load_ratio_spread"] == pytest.approx(0.25)  # ratios 0.5 and 0.25
