"""Cases: the mixture-of-experts MLP (model.moe).

- moe_grouped_vs_loop: one MoE layer's forward and backward at 8 experts, top 2, on the experiment's micro-batch of
  tokens and d_model: the experts as one grouped matmul per product over the tokens sorted by expert, with a
  hand-written backward (lit_pretrain/model/moe_kernels.py) against a Python loop over the experts, each gathering its
  tokens, running its SwiGLU and adding its output back (what transformers' OlmoeExperts does). Same routing, same
  weights. Figure: loop time / grouped time (goal >= 1.5).
- moe_step_vs_dense: a training step of the experiment's model with every MLP an MoE of 8 experts, top 2, each
  expert half the dense MLP's width (so a token's active parameters equal the dense model's, plus the router's
  8 x d_model per layer), against the dense model's step, same windows, same optimizer. Figure: MoE tokens/s over
  dense tokens/s (goal >= 0.7 on CPU).
"""

import time
from dataclasses import replace
from typing import Dict, List

import torch
import torch.nn.functional as F

from lit_pretrain.bench import stats
from lit_pretrain.model.config import MoEConfig
from lit_pretrain.model.moe import MoE, end_step, moe_loss
from lit_pretrain.module import PretrainModule
from lit_pretrain.optim.optimizers import build_optimizer

EXPERTS, TOP_K = 8, 2
# Few steps a side, 5 alternations each: the group took 11 minutes at 12/8 steps on 2 cores at load average 9;
# these keep `make bench`'s added time to about a third of that on such a machine.
LAYER_STEPS, LAYER_SKIP = 6, 1
STEPS, SKIP = 5, 1


def loop_forward(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """`layer`'s forward with its experts run one by one in a Python loop (dropless, no shared experts): the
    reference the grouped matmul is measured against, and tests/model/test_moe.py checks equal to it."""
    flat = x.reshape(-1, x.shape[-1])  # (N, d)
    top, weights, _, _ = layer.route(flat)  # (N, k) each
    out = torch.zeros_like(flat)
    w = {n: m.weight for n, m in layer.experts.items()}
    for e in range(layer.cfg.num_experts):
        token, slot = torch.where(top == e)
        xs = flat[token]  # (n_e, d)
        h = F.silu(xs @ w["w_gate"][e].T) * (xs @ w["w_up"][e].T)
        out.index_add_(0, token, (h @ w["w_down"][e].T) * weights[token, slot, None])
    return out.view_as(x)


def moe_model_cfg(c):
    """The experiment's model with every MLP an MoE of EXPERTS experts, TOP_K per token, each of half the dense
    width: active parameters equal to the dense model's (plus the routers')."""
    width = c.model.hidden_dim // TOP_K
    return replace(c.model, moe=MoEConfig(num_experts=EXPERTS, top_k=TOP_K, d_ff_expert=8 * ((width + 7) // 8),
                                          aux_loss=0.01, router_z_loss=0.001))


def layer_seconds(layer: MoE, x: torch.Tensor, grouped: bool) -> float:
    """Mean seconds of one forward + backward of `layer` on x, over steps LAYER_SKIP..LAYER_STEPS."""
    g = torch.randn_like(x)
    start = None
    for step in range(LAYER_STEPS):
        y = layer(x) if grouped else loop_forward(layer, x)
        (y * g).sum().backward()
        layer.zero_grad(set_to_none=True)
        if step + 1 == LAYER_SKIP:
            start = time.perf_counter()
    return (time.perf_counter() - start) / (LAYER_STEPS - LAYER_SKIP)


def step_seconds(c, model_cfg, windows: torch.Tensor) -> float:
    """Mean seconds per optimizer step (loss with the MoE losses, backward, AdamW, bias update) over SKIP..STEPS."""
    module = PretrainModule(model_cfg, c.optim, c.schedule, max_steps=STEPS, tokens_per_step=1, seed=c.run.seed)
    opt = build_optimizer(module.model, c.optim)
    start = None
    for step, w in enumerate(windows):
        loss = module.loss((w[:, :-1], w[:, 1:]))
        balance = moe_loss(module.model)
        (loss if balance is None else loss + balance).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end_step(module.model)
        if step + 1 == SKIP:
            start = time.perf_counter()
    return (time.perf_counter() - start) / (STEPS - SKIP)


def run(c, repeats: int) -> List[Dict]:
    cfg = moe_model_cfg(c)
    torch.manual_seed(c.run.seed)
    layer = MoE(cfg, 0).train()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    tokens = c.trainer.micro_batch_size * c.model.seq_len
    x = torch.randn(c.trainer.micro_batch_size, c.model.seq_len, c.model.d_model, requires_grad=True)
    loop, grouped = stats.alternate(lambda: layer_seconds(layer, x, grouped=False),
                                    lambda: layer_seconds(layer, x, grouped=True), repeats)
    layer_case = {"case": "moe_grouped_vs_loop", **stats.summary(loop, grouped, lambda g, lp: lp / g),
                  "goal": ">= 1.5", "unit": "s/forward+backward",
                  "detail": {"grouped": grouped, "loop": loop, "experts": EXPERTS, "top_k": TOP_K, "tokens": tokens,
                             "d_model": c.model.d_model, "d_ff_expert": cfg.d_ff_expert,
                             "kernel": "moe_kernels.swiglu_experts (grouped_mm)"}}
    g = torch.Generator().manual_seed(c.run.seed)
    windows = torch.randint(0, c.model.vocab_size, (STEPS, c.trainer.micro_batch_size, c.model.seq_len + 1),
                            generator=g)
    dense, moe = stats.alternate(lambda: tokens / step_seconds(c, c.model, windows),
                                 lambda: tokens / step_seconds(c, cfg, windows), repeats)
    from lit_pretrain.model import shapes

    step_case = {"case": "moe_step_vs_dense", **stats.summary(dense, moe), "goal": ">= 0.7", "unit": "tokens/s",
                 "detail": {"moe": moe, "dense": dense, "timed_steps": STEPS - SKIP,
                            "active_params": {"moe": shapes.active_params(cfg), "dense": shapes.params(c.model)},
                            "total_params": {"moe": shapes.params(cfg), "dense": shapes.params(c.model)}}}
    return [layer_case, step_case]
