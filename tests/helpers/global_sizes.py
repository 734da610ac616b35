"""A finished run's sizes are the whole model's, under any layout: summary.json's params, non-embedding params,
active params and flops_per_token equal one process's GPT of the run's own config (built on the meta device), and
the logged MFU is computed with those FLOPs. Called on the run folders of the end-to-end layout tests."""

import json
from pathlib import Path

import pytest


def one_process_sizes(run_dir: Path) -> dict:
    from lit_pretrain import config
    from lit_pretrain.strategy.mesh_strategy import full_gpt_on_meta

    gpt = full_gpt_on_meta(config.to_object(config.load(run_dir / "config.yaml")).model)
    return {"params": gpt.num_params(non_embedding=False), "non_embedding_params": gpt.num_params(non_embedding=True),
            "active_params": gpt.num_params(non_embedding=False, active=True),
            "flops_per_token": gpt.flops_per_token()}


def assert_global_sizes(run_dir: Path) -> None:
    from lit_pretrain.runs.folder import read_metrics

    want = one_process_sizes(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {k: summary[k] for k in want} == want, run_dir.name  # integers: exact
    assert summary["tokens_per_param"] == summary["tokens_seen"] / want["params"]
    speed = json.loads((run_dir / "stability.json").read_text())["throughput"]
    assert speed["flops_per_token"] == want["flops_per_token"], run_dir.name
    devices = summary["world_size"] * speed["peak_flops_per_s_per_device"]
    rows = [r for r in read_metrics(run_dir / "metrics.csv") if "throughput/mfu" in r]
    assert rows, run_dir.name
    for r in rows:
        # MFU = flops_per_token x tokens/s / (peak x devices) (callbacks/throughput.py); the CSV holds each float's
        # repr, so only the products' own rounding (a few ulps) separates the two sides.
        assert r["throughput/flops_per_s"] == pytest.approx(r["throughput/tokens_per_s"] * want["flops_per_token"],
                                                            rel=1e-12)
        assert r["throughput/mfu"] == pytest.approx(r["throughput/flops_per_s"] / devices, rel=1e-12)
