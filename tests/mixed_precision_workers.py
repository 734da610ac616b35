"""Workers for tests/test_mixed_precision.py (no Lightning imported: spawned ranks start faster).

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
from lit_pretrain.parallel.plan import ParallelPlan
from lit_pretrain.schema import OptimConfig

STEPS, BATCH, SEQ, VOCAB = 200, 8, 32, 64
CFG = dict(vocab_size=VOCAB, n_layers=2, d_model=64, n_heads=4, seq_len=SEQ)
OPTIM = OptimConfig(lr_peak=1e-3, grad_clip_norm=1.0)
LAST = 20  # the final loss: the mean of the last 20 steps' losses


def markov_windows(n: int, seed: int = 0) -> torch.Tensor:
    """tests/test_bf16.py's data: a fixed random Markov chain the tiny model is still learning at step 200."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.full((VOCAB, VOCAB), -4.0)
    logits.scatter_(1, torch.randint(0, VOCAB, (VOCAB, 4), generator=g), 2.0)
    probs = logits.softmax(-1)
    out = torch.empty(n, SEQ + 1, dtype=torch.long)
    out[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(SEQ):
        out[:, t + 1] = torch.multinomial(probs[out[:, t]], 1, generator=g).squeeze(1)
    return out


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
