"""callbacks/console.py: the known noise is dropped by its exact message, nothing else; the progress bar only on
a terminal (tests/parallel/test_ddp.py checks the console of a whole 2-process run)."""

import io
import logging
import warnings

from lit_pretrain.callbacks import console


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal_a_line_per_validation_in_a_log_file():
    bar = console.progress_callbacks(True, refresh_rate=2, stream=Terminal())
    assert [type(cb) for cb in bar] == [console.ProgressBar] and bar[0].refresh_rate == 2 and console.has_bar(bar)
    lines = console.progress_callbacks(True, refresh_rate=2, stream=io.StringIO())
    assert [type(cb) for cb in lines] == [console.ValidationLine] and not console.has_bar(lines)
    # trainer.log_every_n_steps: a line every that many steps as well (tests/scaling/test_ladder.py reads them in a
    # run's log)
    lines = console.progress_callbacks(True, refresh_rate=2, stream=io.StringIO(), log_every_n_steps=5)
    assert [type(cb) for cb in lines] == [console.StepLine, console.ValidationLine] and lines[0].every_n_steps == 5
    assert [type(cb) for cb in console.progress_callbacks(True, 2, stream=Terminal(), log_every_n_steps=5)] == \
        [console.ProgressBar]
    assert console.progress_callbacks(False, refresh_rate=2, stream=Terminal()) == []


def test_only_the_known_noise_is_dropped(caplog):
    console.quiet()
    console.quiet()  # once per rank, and again per train() in one process: one filter
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        console.quiet()  # the filters go in front of "always", as in a run
        leaf = "`isinstance(treespec, LeafSpec)` is deprecated, use ..."
        warnings.warn(leaf, FutureWarning, stacklevel=1)
        warnings.warn(leaf, UserWarning, stacklevel=1)  # another category
        warnings.warn("something else is deprecated", FutureWarning, stacklevel=1)
    assert [(w.category, str(w.message)[:13]) for w in caught] == [(UserWarning, "`isinstance(t"),
                                                                   (FutureWarning, "something els")]
    logger = logging.getLogger(console.RANK_ZERO_LOGGER)
    assert sum(isinstance(f, console._DropNoise) for f in logger.filters) == 1
    with caplog.at_level(logging.INFO, logger=console.RANK_ZERO_LOGGER):
        logger.info("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]")
        logger.info("GPU available: False, used: False")
    assert [r.getMessage() for r in caplog.records] == ["GPU available: False, used: False"]


def test_step_line_says_step_total_loss_tokens_per_second_mfu_and_time_left():
    assert console.step_line(10, 200, 5.123449, 12345.6, 0.3121, 125.4) == \
        "step 10/200: train/loss 5.1234, 12,346 tokens/s, MFU 31.2%, 2:05 left"
    # no peak known (a device outside the table): no MFU
    assert console.step_line(200, 200, 3.2, 900.0, None, 0.0) == \
        "step 200/200: train/loss 3.2000, 900 tokens/s, 0:00 left"
    assert console.step_line(5, 100_000, None, 1e6, 0.5, 3 * 3600 + 61) == \
        "step 5/100000: 1,000,000 tokens/s, MFU 50.0%, 3:01:01 left"
