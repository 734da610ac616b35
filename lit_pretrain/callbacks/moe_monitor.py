"""MoEMonitor: each mixture-of-experts layer's routing, logged, and router collapse recorded as an event.

Router collapse is the failure mode of learned routing (Shazeer et al. 2017 §4; Fedus et al. 2021 §2.2): a few
experts win every token, the others stop learning, and the model degenerates towards a dense one of an expert's
width. Here it is an expert taking more than `collapse_share` of a layer's assignments at `window` logged steps in a
row; the event (label "router_collapse", with layer, expert and share) stays open until the share falls back, and
is listed in the stability report with the loss spikes.

The statistics are those `moe.end_step` kept after the optimizer step, already summed over the data-parallel ranks,
so every rank sees the same values and takes the same decision without a collective (under pipeline parallelism one
object gather over the stages, which hold different layers). They are read on the host only at logged steps.
"""

from typing import Dict, List, Optional

from lightning.pytorch.callbacks import Callback

from lit_pretrain.callbacks.records import write_json
from lit_pretrain.model.moe import moe_layers, step_statistics

LABEL = "router_collapse"


class MoEMonitor(Callback):
    def __init__(self, log_every_n_steps: int = 10, collapse_share: float = 0.5, window: int = 3,
                 filename: str = "router_collapse.json"):
        self.log_every_n_steps, self.collapse_share, self.window = log_every_n_steps, collapse_share, window
        self.filename = filename
        self.events: List[Dict] = []
        self._streak: Dict[int, int] = {}  # layer -> logged steps in a row above the share
        self._open: Dict[int, Dict] = {}  # layer -> its open event
        self._seen = -1  # the last step logged

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._seen or not (step % self.log_every_n_steps == 0 or step >= trainer.max_steps):
            return
        self._seen = step
        by_layer = {}
        for layer in moe_layers(pl_module.model):
            stats = step_statistics(layer)
            if stats is not None:  # one host read per logged step
                by_layer[layer.layer] = ({k: float(v) for k, v in stats.items()},
                                         int(layer.step_stats[:layer.cfg.num_experts].argmax()))
        parallel = getattr(pl_module, "parallel", None)
        if parallel is not None and parallel.runner is not None:
            # Pipeline stages hold other layers: every rank gathers them all (rank 0's logger writes, and every rank
            # takes the same collapse decisions).
            import torch.distributed as dist

            parts = [None] * parallel.p
            dist.all_gather_object(parts, by_layer, group=parallel.pp)
            by_layer = {k: v for part in parts for k, v in part.items()}
        for index in sorted(by_layer):
            values, expert = by_layer[index]
            for key, value in values.items():
                pl_module.log(f"moe/layer{index}/{key}", value)
            self.observe(step, index, values["max_share"], expert)

    def observe(self, step: int, layer: int, share: float, expert: int) -> Optional[Dict]:
        """Feed one logged step's top-expert share of `layer`; returns the event it opens, if any."""
        if share > self.collapse_share:
            self._streak[layer] = self._streak.get(layer, 0) + 1
            if self._streak[layer] == self.window and layer not in self._open:
                event = {"label": LABEL, "step": step, "layer": layer, "expert": expert, "share": share,
                         "threshold": self.collapse_share, "window": self.window, "resolved_step": None}
                self.events.append(event)
                self._open[layer] = event
                return event
        else:
            self._streak[layer] = 0
            event = self._open.pop(layer, None)
            if event is not None:
                event["resolved_step"] = step
        return None

    def summary(self) -> Dict:
        return {"events": len(self.events), "open": len(self._open), "list": self.events}

    def on_train_end(self, trainer, pl_module) -> None:
        write_json(trainer, self.filename, self.summary())
