"""Case: generation tokens/s with the KV cache against recomputing the whole prefix every step.

Same model (the experiment's, randomly initialized: speed does not depend on what it learned), same prompt,
greedy decoding without an end-of-document stop, so both sides take exactly NEW_TOKENS steps. Recomputation costs
a forward over the whole prefix each step (O(T²) tokens over a generation); the cache, one token's forward and an
attention over the cached keys (O(T)). The context is stretched to the prompt plus NEW_TOKENS positions: only
the RoPE tables grow, the weights are the same shapes.
"""

import dataclasses
from typing import Dict

import torch

from lit_pretrain.bench.step.step import paired_case
from lit_pretrain.evaluation.generate import generate
from lit_pretrain.model.gpt import GPT

NEW_TOKENS, PROMPT_TOKENS = 256, 32


def run(c, repeats: int) -> Dict:
    cfg = dataclasses.replace(c.model, seq_len=max(c.model.seq_len, PROMPT_TOKENS + NEW_TOKENS))
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    prompt = torch.randint(cfg.vocab_size, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()

    def tokens_per_s(use_cache: bool) -> float:
        result = generate(model, prompt, NEW_TOKENS, temperature=0, use_cache=use_cache)
        assert result.steps == NEW_TOKENS  # no stop token, room in the context: both sides do the same steps
        return result.tokens_per_s

    tokens_per_s(True)  # warm-up: first-call allocations and kernel selection, on neither side's clock
    return paired_case("generation_tokens_per_s", lambda: tokens_per_s(False), lambda: tokens_per_s(True), repeats,
                       ">= 5", "tokens/s", ("recompute", "kv_cache"),
                       {"new_tokens": NEW_TOKENS, "prompt_tokens": PROMPT_TOKENS, "batch": 1,
                        "params": model.num_params(non_embedding=False)})
