"""Cases: a training step of each attention and model variant against the same step of the baseline block.

The experiment's model, micro-batch and optimizer in masking.py's plain loop (window.py's `step_seconds`), on the
same random windows, alternated with the baseline so a loaded machine moves both: attention sinks (SDPA's math path:
the sink is one more key of the float mask), the elementwise attention gate (one more d_model x d_model matmul),
multi-head latent attention at MLAConfig's default ranks, and one multi-token-prediction depth (a block and a pass
through the head more). Each figure is the variant's step time over the baseline's (docs/model.md says where each
variant lives; sliding windows have their own case, window.py).
"""

import dataclasses
from typing import Dict, List

from lit_pretrain.bench import stats
from lit_pretrain.bench.step.masking import SKIP, STEPS
from lit_pretrain.bench.step.window import step_seconds
from lit_pretrain.model.config import MLAConfig

# case name -> the model keys it changes (model.attention=mla drops the grouped-query heads it replaces)
VARIANTS = {
    "attention_sinks_step_time": {"attention_sinks": True},
    "attention_gate_step_time": {"attention_gate": "elementwise"},
    "latent_attention_step_time": {"attention": "mla", "mla": MLAConfig(), "n_kv_heads": None, "qk_norm": False},
    "mtp_depth_1_step_time": {"mtp_depth": 1},
}


def run(c, repeats: int) -> List[Dict]:
    """Per variant: alternate baseline and variant `repeats` times; medians and the spread of variant / baseline."""
    out = []
    for case, keys in VARIANTS.items():
        variant = dataclasses.replace(c.model, **keys)
        variant.check()
        base, other = stats.alternate(lambda: step_seconds(c, c.model), lambda v=variant: step_seconds(c, v), repeats)
        out.append({"case": case, **stats.summary(base, other), "goal": "report", "unit": "s/step",
                    "detail": {"variant": other, "baseline": base, "timed_steps": STEPS - SKIP,
                               "keys": {k: str(v) for k, v in keys.items()},
                               "tokens_per_step": c.trainer.micro_batch_size * c.model.seq_len}})
    return out
