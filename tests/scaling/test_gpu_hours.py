"""`lit-pretrain plan --run FILE` in GPU-hours (scaling/gpu_hours.py): at the MFU a user gives, or at the one
`make bench-gpu` measured for the nearest benchmarked model and the run's setting (bench/step/gpu_cases.py)."""

import dataclasses
import json
from pathlib import Path

import pytest

from lit_pretrain.errors import ConfigError
from lit_pretrain.scaling.cli import main
from lit_pretrain.scaling.gpu_hours import bench_case_for, gpu_hours, measured_mfu

# FSDP over one node's 8 GPUs, where trainer.float8 runs (HSDP, the 32-GPU file's layout, is refused with it).
RUN = str(Path(__file__).resolve().parents[2] / "experiments" / "runs" / "llama3_1_8b_h200x8.yaml")


@pytest.mark.parametrize("flops, mfu, peak, hours", [
    (3.6e18, 0.5, 1e15, 2.0),  # 3.6e18 / (0.5 x 1e15 FLOP/s) = 7,200 s
    # Llama 3.1 8B (model card: 1.46M H100-80GB GPU-hours for 15T+ tokens): 6 x 8.03e9 x 15e12 = 7.227e23 FLOPs
    # over 989 TFLOP/s take 1.46M hours at MFU 13.9% (all its hours, not only the pretraining's steady state).
    (6 * 8.03e9 * 15e12, 0.139, 989e12, 1.46e6),
])
def test_gpu_hours_are_flops_over_mfu_times_peak(flops, mfu, peak, hours):
    assert gpu_hours(flops, mfu, peak) == pytest.approx(hours, rel=5e-3)


def test_an_mfu_outside_zero_to_one_is_refused():
    for mfu in (0.0, 40.0):
        with pytest.raises(ConfigError, match="--mfu"):
            gpu_hours(1e20, mfu, 989e12)


def bench_results():
    """A results file in the format bench-gpu writes (its own functions build the cases): two models, bf16 compiled
    at MFU 0.30 and 0.45, and the 1B's fp8 rowwise case at 1.2x its tokens/s."""
    from lit_pretrain.bench.step import gpu_cases, mfu
    from lit_pretrain.model.config import GPTConfig
    from lit_pretrain.schema import Config

    cases, peak = [], 1e15
    for name, flops_per_token, tokens in (("125m", 1e9, 0.30e6), ("1b", 7e9, 0.45e15 / 7e9)):
        cases += mfu.cases({f"gpu_{name}_compiled": tokens}, flops_per_token, peak, {})
    c = dataclasses.replace(Config(), model=GPTConfig(vocab_size=64))
    cases += gpu_cases.run_cases(c, "1b", ["fp8_rowwise"], lambda run, callbacks: 1.2 * 0.45e15 / 7e9,
                                 0.45e15 / 7e9, 7e9, peak, 1)
    return {"machine": {"gpu": "NVIDIA H200"}, "cases": cases}


def test_the_measured_mfu_is_the_nearest_model_s_for_the_run_s_setting():
    results = bench_results()
    assert measured_mfu(results, 6.5e9, "compiled") == pytest.approx((0.45, "mfu_gpu_1b_compiled"))
    assert measured_mfu(results, 6.5e9, "fp8_rowwise") == pytest.approx((0.54, "gpu_1b_fp8_rowwise_tokens_per_s"))
    assert measured_mfu(results, 1.5e9, "fp8_rowwise") == pytest.approx((0.30, "mfu_gpu_125m_compiled"))  # none: bf16
    assert measured_mfu({"cases": []}, 1e9, "compiled") is None


def test_plan_prints_gpu_hours_at_the_given_or_the_measured_mfu(tmp_path, capsys):
    assert main(["plan", "--run", RUN, "--bench", str(tmp_path / "none.json")]) == 0
    assert "GPU-hours" not in capsys.readouterr().out  # no --mfu and no bench result: no figure
    # 9.3e21 FLOPs (8B, 160.6B tokens, with attention) / (0.4 x 989e12) / 3600 = 6,531 GPU-hours.
    assert main(["plan", "--run", RUN, "--mfu", "0.4", "--gpu", "H200", "--bench", str(tmp_path / "none.json")]) == 0
    assert "GPU-hours: 6,531 at MFU 40.0% of one H200's 989 TFLOP/s (dense bf16) (--mfu)" in capsys.readouterr().out
    bench = tmp_path / "results-gpu.json"
    bench.write_text(json.dumps(bench_results()))
    assert main(["plan", "--run", RUN, "--bench", str(bench), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["gpu_hours"]
    assert (out["mfu"], out["gpu"]) == (pytest.approx(0.45), "NVIDIA H200")  # the 8B nearest the 1B, bf16 compiled
    assert out["hours"] == pytest.approx(6531 * 0.4 / 0.45, rel=1e-3) and str(bench) in out["source"]
    assert main(["plan", "--run", RUN, "trainer.float8={}", "--bench", str(bench)]) == 0
    assert f"MFU 54.0% of one NVIDIA H200's 989 TFLOP/s (dense bf16) (measured: gpu_1b_fp8_rowwise_tokens_per_s in " \
           f"{bench})" in capsys.readouterr().out
    assert main(["plan", "--run", RUN, "--mfu", "0.4", "--gpu", "TPU"]) == 2
    assert "--gpu TPU: no datasheet peak" in capsys.readouterr().err


def test_the_bench_case_a_run_matches():
    from lit_pretrain.schema import Float8Config

    assert bench_case_for(None, "none") == "compiled"
    assert bench_case_for(None, "selective") == "selective"
    assert bench_case_for(Float8Config("tensorwise"), "selective") == "fp8_tensorwise"
    assert bench_case_for(Float8Config("rowwise_with_gw_hp"), "none") == "fp8_rowwise"
