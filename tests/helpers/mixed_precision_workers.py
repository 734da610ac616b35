"""Workers for tests/parallel/test_mixed_precision.py, run in its own process (one rank).

`train`: 200 AdamW steps of a tiny GPT under FSDP2 on the process group this process holds (one rank is enough for
the math: FSDP2 then skips its collectives but still casts parameters and gradients as the policy says), in one of
three recipes:
- "policy": MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), no autocast (strategy.mixed_precision_policy);
- "autocast": fp32 parameters gathered, torch.autocast(bf16) around the forward (Lightning's bf16-mixed before);
- "bf16_weights": the negative control, master weights and AdamW state in bf16 (what mixed precision exists to
  avoid: Micikevicius et al. 2018, §3.1), FSDP2 without a policy.
The bytes are counted by the bench's own case (lit_pretrain/bench/parallel/mixed_precision.py).
"""

import torch

from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT
from lit_pretrain.model.losses import lm_losses
from lit_pretrain.optim.optimizers import build_adamw, clip_by_global_norm
from lit_pretrain.parallel.apply import apply_plan
from lit_pretrain.planning.plan import ParallelPlan

# tests/parallel/test_bf16.py's model, optimizer, data and final-loss window: the policy is compared on the run that
# test compares bf16-mixed with fp32 on (a Markov chain the tiny model is still learning at step 200)
from tests.parallel.test_bf16 import BATCH, CFG, LAST, OPTIM, STEPS, markov_windows


def sharded(recipe: str, mesh, seed: int, stage: int = 3):
    """A tiny GPT under FSDP2 at `stage` in `recipe`'s dtypes (through apply_plan, as the module applies it), and
    its AdamW."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**CFG))
    if recipe == "bf16_weights":
        model.to(torch.bfloat16)
    apply_plan(model, ParallelPlan(zero_stage=stage, mixed_precision_policy=recipe == "policy"), fsdp_mesh=mesh)
    return model, build_adamw(model, OPTIM, kernel="foreach")


def step(model, opt, recipe: str, x, y) -> float:
    opt.zero_grad()
    with torch.autocast("cpu", torch.bfloat16, enabled=recipe == "autocast"):
        loss = lm_losses(model(x), y)[0]
    loss.backward()
    clip_by_global_norm(model.parameters(), OPTIM.grad_clip_norm)
    opt.step()
    return loss.item()


def train(recipe: str, seed: int, mesh, steps: int = STEPS) -> dict:
    data = markov_windows(steps * BATCH)
    model, opt = sharded(recipe, mesh, seed)
    dtypes = set()
    hook = model.blocks[0].attn.wq.register_forward_hook(lambda m, i, o: dtypes.add(o.dtype))
    losses = [step(model, opt, recipe, data[i * BATCH:(i + 1) * BATCH, :-1], data[i * BATCH:(i + 1) * BATCH, 1:])
              for i in range(steps)]
    hook.remove()
    state = [s for s in opt.state.values()]
    return {"final": sum(losses[-LAST:]) / LAST, "losses": losses, "matmul_dtypes": dtypes,
            "param_dtypes": {p.dtype for p in model.parameters()}, "grad_dtypes": {p.grad.dtype for p in
                                                                                 model.parameters()},
            "state_dtypes": {v.dtype for s in state for k, v in s.items() if k != "step"}}
