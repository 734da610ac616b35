"""A global batch that grows during training (trainer.batch_schedule), as pure functions of the optimizer step.

The schedule is a list of (at_step, tokens_per_step): step s (0-based: the update made when trainer.global_step == s)
trains on the tokens_per_step of the last entry with at_step <= s. The batch grows the way OLMo-core's batch-size
scheduler and the critical-batch-size work argue for (McCandlish et al. 2018: the useful batch, the gradient noise
scale, grows as the loss falls; Merrill et al. 2025: the critical batch size grows early in training).

Lightning steps the optimizer every accumulate_grad_batches micro-batches of its epoch, one number per fit, so the
accumulation stays fixed and the micro-batch changes at each change instead: the planned micro-batch is the largest
scheduled batch / (data-parallel degree x accumulation), and every scheduled batch must split over the same
data-parallel degree x accumulation (`check`, at load). One map, `StepWindows`, says which windows of the data order
each step holds (windows before step s = the sum of the batches of steps 0..s-1): the data loader, a resume on any
layout, tokens_seen and the console all read it, so a position in the run stays one number of global windows.

The learning rate follows the batch (`lr_factor`): optim.lr_peak is the rate at the first scheduled batch, and a
batch k times larger trains at sqrt(k) times it (Malladi et al. 2022, section 4: the square-root scaling rule of the
SDE approximation of Adam), k times it (linear: Goyal et al. 2017, section 2.1, for SGD), or unchanged (none).

Pure: no torch, so `show` refuses what `train` would.
"""

import bisect
from typing import List, Sequence, Tuple

from lit_pretrain.errors import ConfigError

LR_RULES = {"sqrt": 0.5, "linear": 1.0, "none": 0.0}
"""trainer.batch_schedule_lr: the learning rate scales as (batch / first batch) ** exponent."""


def entries(schedule) -> List[Tuple[int, int]]:
    """(at_step, tokens_per_step) of each trainer.batch_schedule entry (schema objects or plain dicts)."""
    out = []
    for e in schedule:
        at, tokens = (e["at_step"], e["tokens_per_step"]) if isinstance(e, dict) else (e.at_step, e.tokens_per_step)
        out.append((int(at), int(tokens)))
    return out


class StepWindows:
    """The step-to-window map of a schedule in windows per step (tokens_per_step / seq_len): `before(s)` windows
    are consumed before step s, step s holds [before(s), before(s + 1)). A fixed batch is the schedule [(0, n)]."""

    def __init__(self, changes: Sequence[Tuple[int, int]]):
        self.steps = [at for at, _ in changes]
        self.sizes = [n for _, n in changes]
        self.starts = [0]  # windows before each change's step
        for i in range(1, len(changes)):
            self.starts.append(self.starts[-1] + (self.steps[i] - self.steps[i - 1]) * self.sizes[i - 1])

    def size(self, step: int) -> int:
        """Windows of step `step`."""
        return self.sizes[bisect.bisect_right(self.steps, step) - 1]

    def before(self, step: int) -> int:
        """Windows of the steps before `step`."""
        i = bisect.bisect_right(self.steps, step) - 1
        return self.starts[i] + (step - self.steps[i]) * self.sizes[i]

    def locate(self, windows: int) -> Tuple[int, int]:
        """(step, windows into it) of the position `windows` of the order."""
        i = bisect.bisect_right(self.starts, windows) - 1
        step, offset = divmod(windows - self.starts[i], self.sizes[i])
        return self.steps[i] + step, offset

    def steps_within(self, windows: int) -> int:
        """Whole steps whose windows fit in the first `windows` of the order."""
        step, _ = self.locate(windows)
        return step


def step_windows(schedule, seq_len: int, tokens_per_step: int) -> StepWindows:
    """The map of trainer.batch_schedule in windows of seq_len tokens; an empty schedule: tokens_per_step each
    step."""
    changes = entries(schedule) or [(0, tokens_per_step)]
    return StepWindows([(at, tokens // seq_len) for at, tokens in changes])


def lr_factor(schedule, rule: str, step: int) -> float:
    """The learning-rate multiplier of step `step`: (its batch / the first batch) ** the rule's exponent."""
    changes = entries(schedule)
    if not changes or rule == "none":
        return 1.0
    batch = changes[bisect.bisect_right([at for at, _ in changes], step) - 1][1]
    return (batch / changes[0][1]) ** LR_RULES[rule]


def largest(schedule) -> int:
    """The largest scheduled batch in tokens: the planned one (micro-batch and accumulation are set from it)."""
    return max(tokens for _, tokens in entries(schedule))


def check(schedule, seq_len: int, data_parallel: int, accumulation: int) -> List[int]:
    """The micro-batch of each entry on this layout; a ConfigError naming the entry that does not split into whole
    micro-batches of data_parallel x accumulation."""
    per = seq_len * data_parallel * accumulation
    micro = []
    for i, (at, tokens) in enumerate(entries(schedule)):
        if tokens % per:
            raise ConfigError(
                f"trainer.batch_schedule[{i}].tokens_per_step={tokens} (from step {at}) does not split over this "
                f"layout: the accumulation is fixed for the run ({accumulation}, set by the largest entry and "
                f"trainer.micro_batch_size) and each entry must be a multiple of model.seq_len={seq_len} x "
                f"data-parallel degree {data_parallel} x accumulation {accumulation} = {per} tokens: set it to a "
                f"multiple of {per}, or a larger trainer.micro_batch_size (a smaller accumulation)")
        micro.append(tokens // per)
    return micro


def schedule_line(schedule, batch, rule: str) -> str:
    """The schedule a run applies, in one line (train prints it under the plan line, whose batch is the largest):
    each entry's tokens, micro-batch and learning-rate factor."""
    per = batch.seq_len * batch.data_parallel * batch.accumulation
    parts = [f"{tokens:,} tokens (micro-batch {tokens // per}, lr x {lr_factor(schedule, rule, at):.4g}) from step {at}"
             for at, tokens in entries(schedule)]
    return f"batch schedule (trainer.batch_schedule_lr={rule}): " + "; ".join(parts)
