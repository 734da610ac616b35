"""Workers of tests/strategy/test_strategies.py's two-process check (no lightning import here: a spawned child imports
this module, and importing lightning would add seconds to every start)."""

import json
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT
from lit_pretrain.optim.optimizers import build_optimizer, local_optimizer
from lit_pretrain.schema import OptimConfig


def optimizer_state_names(rank: int, world: int, init: str, zero_stage: int, out: str) -> None:
    """One AdamW step of a tiny GPT under the optimizer zero_stage builds; writes the parameters whose state this
    rank holds to out/rank.json."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=2, seq_len=8))
        opt = build_optimizer(model, OptimConfig(), zero_stage=zero_stage)
        sum(p.square().sum() for p in model.parameters()).backward()
        opt.step()
        held = local_optimizer(opt).state
        names = sorted(n for n, p in model.named_parameters() if held.get(p))
        (Path(out) / f"{rank}.json").write_text(json.dumps(names))
    finally:
        dist.destroy_process_group()
