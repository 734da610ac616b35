"""Cases: step time of each strategy on 2 processes against one process on the same global batch (activation
checkpointing's cases are the step group's: bench/step/checkpointing.py).

Strategy runs go through our Trainer set-up (build_strategy, PretrainModule with configure_model) on in-memory
random windows: the data path is a case of its own. Each strategy runs in a subprocess (this module, run as
`python -m lit_pretrain.bench.parallel.strategies`), which Lightning's launcher re-runs for rank 1. On a 2-core machine
2 ranks × 1 thread do not beat 1 process × 2 threads: the ratios report the cost of communication and sharding,
not a speed-up.
"""

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from lit_pretrain.bench import stats

STRATEGIES = {"ddp": ("ddp", None), "zero1": ("zero", 1), "zero2": ("zero", 2), "zero3": ("zero", 3)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(run_file: str, overrides: list, name: str, devices: int, global_batch: int, steps: int,
            skip: int) -> list:
    """Seconds of each timed optimizer step of one strategy, measured in a fresh set of processes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
        for var in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"):
            env.pop(var, None)
        cmd = [sys.executable, "-m", "lit_pretrain.bench.parallel.strategies", "--name", name,
               "--devices", str(devices), "--global-batch", str(global_batch), "--steps", str(steps),
               "--skip", str(skip), "--out", str(out), run_file, *overrides]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"bench strategy {name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        return json.loads(out.read_text())["step_seconds"]


def _worker(args) -> None:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lit_pretrain import config as config_lib
    from lit_pretrain.bench.step.step import _StepClock
    from lit_pretrain.module import PretrainModule
    from lit_pretrain.planning.plan import plan_from
    from lit_pretrain.schema import StrategyConfig
    from lit_pretrain.strategy.build import build_strategy
    from lit_pretrain.train import resolve_vocab, setup_process

    c = config_lib.load(args.run_file, args.overrides)
    c = resolve_vocab(c, c.data.vocab_size)
    kind, stage = ("single", None) if args.name == "single" else STRATEGIES[args.name]
    trainer_cfg = dataclasses.replace(c.trainer, devices=args.devices, num_nodes=1, num_threads=None)
    setup_process(trainer_cfg)
    strategy_cfg = StrategyConfig(name=kind, zero_stage=stage or 3, timeout_seconds=120)
    micro = args.global_batch // args.devices
    # The same random windows on every rank: the cost of a step does not depend on which tokens it sees.
    g = torch.Generator().manual_seed(c.run.seed)
    windows = torch.randint(0, c.model.vocab_size, (args.steps * micro, c.model.seq_len + 1), generator=g)
    data = DataLoader(TensorDataset(windows[:, :-1], windows[:, 1:]), batch_size=micro)
    plan = plan_from(strategy_cfg, trainer_cfg)
    module = PretrainModule(c.model, c.optim, c.schedule, max_steps=args.steps,
                            tokens_per_step=args.global_batch * c.model.seq_len, seed=c.run.seed,
                            strategy=strategy_cfg, plan=plan)
    clock = _StepClock(args.skip)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(accelerator="cpu", devices=args.devices,
                            strategy=build_strategy(strategy_cfg, trainer_cfg, plan),
                            max_steps=args.steps, limit_val_batches=0, logger=False, callbacks=[clock],
                            enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                            use_distributed_sampler=False, default_root_dir=tmp)
        trainer.fit(module, data)
    if trainer.is_global_zero:
        Path(args.out).write_text(json.dumps({"step_seconds": clock.step_seconds()}))


def run(c, run_file: str = "experiments/runs/default.yaml", overrides=(), devices: int = 2,
        steps: int = 2 + stats.ALTERNATIONS, skip: int = 2) -> list:
    """One case per strategy (seconds per step on `devices` processes / one process). Activation checkpointing's
    none / selective / full cases are the step group's (bench/step/checkpointing.py).

    A launch costs ~10 s of start-up against a fraction of a second a step, so the pairs are timed steps, not
    alternated launches: step i of the strategy against step i of the one process (bench/stats.py)."""
    global_batch = c.trainer.micro_batch_size
    if global_batch % devices:
        raise ValueError(f"trainer.micro_batch_size={global_batch} must divide by {devices} processes for the bench")
    overrides = [*overrides, f"model.vocab_size={c.model.vocab_size}"]
    single = _launch(run_file, overrides, "single", 1, global_batch, steps, skip)
    cases = []
    for name in STRATEGIES:
        t = _launch(run_file, overrides, name, devices, global_batch, steps, skip)
        cases.append({"case": f"step_seconds_{name}_{devices}proc", **stats.summary(single, t),
                      "goal": "report (no speed-up expected on 2 cores)", "unit": "s/step",
                      "detail": {"global_batch": global_batch, "timed_steps": steps - skip,
                                 "pairs": "timed step i of each side"}})
    return cases


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True, choices=["single", *STRATEGIES])
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--skip", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("run_file")
    parser.add_argument("overrides", nargs="*")
    _worker(parser.parse_args())
