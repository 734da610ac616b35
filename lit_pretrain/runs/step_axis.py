"""Every metrics row Lightning writes is tagged with the optimizer steps completed (PretrainModule.setup installs it).

One meaning of "step" in the whole project (metrics.csv, TensorBoard, W&B, the console, checkpoint names,
summary.json, `runs`, `compare`, the plots): optimizer steps completed when the value was measured. The loss of the
first step is logged at step 1; validation after step k at k; the last row of a 200-step run at 200, where
`step0000200.ckpt` and summary.json's `steps` say 200 too (torchtitan numbers its steps the same way, from 1).

Lightning tags what `self.log` records (the module's and every callback's) with its loop counter
`_batches_that_stepped`, which is incremented only after a step's metrics are written and its validation has run:
the loss of step k lands at k - 1 (on_train_batch_end), and so does the validation after it, while after `fit` a
`trainer.validate` lands at k. This makes the Trainer's logger connector use `trainer.global_step` (the optimizer
steps completed) wherever Lightning would pick the step itself. A caller that names a step (the monitors that write
to the loggers directly, with `step=trainer.global_step`) and a logged `step` metric (Lightning's documented
override) are left as they are; Lightning's own `epoch` column is kept.
"""

from lit_pretrain.internals import logger_connector


def log_at_steps_completed(trainer) -> None:
    """Make `trainer` tag logged rows with trainer.global_step; a second call on the same Trainer does nothing."""
    connector = logger_connector(trainer)
    if getattr(connector, "_steps_completed", False):
        return
    lightning_log_metrics = connector.log_metrics

    def log_metrics(metrics, step=None):
        if metrics and step is None and "step" not in metrics:  # Lightning writes no row for no metrics
            metrics = {"epoch": trainer.current_epoch, **metrics}
            step = trainer.global_step
        lightning_log_metrics(metrics, step)

    connector.log_metrics = log_metrics
    connector._steps_completed = True
