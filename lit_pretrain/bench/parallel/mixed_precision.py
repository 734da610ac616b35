"""Cases: the bytes FSDP2 moves per rank and step with and without the mixed-precision policy
(strategy.mixed_precision_policy; parallel/zero.py), ZeRO-2 and ZeRO-3 on 2 spawned gloo ranks, counted by
compositions.py's CountCollectives. The policy gathers bf16 parameters: the all-gather bytes are 0.5 of fp32's (the
same rows, padding included); it reduces in fp32: the reduce-scatter bytes are fp32's. A third setting, a bf16
reduce dtype, is the negative control the tests use (its reduce-scatter halves).
"""

import os
from dataclasses import asdict
from datetime import timedelta

import torch
import torch.distributed as dist

WORLD = 2
SETTINGS = ("fp32", "policy", "bf16_reduce")


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def _policy(name: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lit_pretrain.parallel.zero import mixed_precision_policy

    return {"fp32": None, "policy": mixed_precision_policy(),
            "bf16_reduce": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)}[name]


def count_bytes(rank: int, port: int, model: dict, batch: int, results) -> None:
    """Spawned rank: for ZeRO-2 and 3 and each setting, one AdamW step (its state appears), then one counted step
    (forward, backward, AdamW). `model`: GPTConfig fields; `batch`: this rank's micro-batch."""
    from torch.distributed.device_mesh import init_device_mesh

    from lit_pretrain.bench.parallel.compositions import CountCollectives
    from lit_pretrain.model.config import GPTConfig
    from lit_pretrain.model.gpt import GPT
    from lit_pretrain.model.losses import lm_losses
    from lit_pretrain.optim.optimizers import build_adamw
    from lit_pretrain.parallel.zero import shard_model
    from lit_pretrain.schema import OptimConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        cfg = GPTConfig(**model)
        g = torch.Generator().manual_seed(rank)
        x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)
        out = {}
        for stage in (2, 3):
            for name in SETTINGS:
                torch.manual_seed(0)
                gpt = shard_model(GPT(cfg), mesh, stage, mp_policy=_policy(name))
                opt = build_adamw(gpt, OptimConfig(), kernel="foreach")

                for counted in (False, True):
                    with CountCollectives() if counted else _nothing() as counter:
                        opt.zero_grad()
                        lm_losses(gpt(x[:, :-1]), x[:, 1:])[0].backward()
                        opt.step()
                out[(stage, name)] = dict(counter.bytes)
        if rank == 0:
            results.update(out)
    finally:
        dist.destroy_process_group()


def measure(model: dict, batch: int) -> dict:
    """{(stage, setting): {kind: bytes}} of rank 0, from 2 spawned ranks."""
    import torch.multiprocessing as mp

    from lit_pretrain.bench.parallel.compositions import _free_port

    with mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        mp.start_processes(count_bytes, args=(_free_port(), model, batch, results), nprocs=WORLD, join=True,
                           start_method="spawn")
        return dict(results)


def run(c) -> list:
    model = {k: v for k, v in asdict(c.model).items() if k != "moe" or v is None}
    measured = measure(model, max(1, c.trainer.micro_batch_size // WORLD))
    cases = []
    for stage in (2, 3):
        fp32, policy = measured[(stage, "fp32")], measured[(stage, "policy")]
        for kind, goal in (("all_gather", "0.495-0.505 (bf16 parameters gathered)"),
                           ("reduce_scatter", "1.0 (fp32 reduction)")):
            cases.append({"case": f"comm_bytes_zero{stage}_mixed_precision_{kind}", "value": policy[kind],
                          "reference": fp32[kind], "ratio": policy[kind] / fp32[kind], "goal": goal,
                          "unit": "bytes/rank/step", "detail": {"world": WORLD, "fp32": fp32, "policy": policy}})
    return cases
