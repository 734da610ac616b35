"""Per-rank RNG state, the loader's data position across world sizes, and the preemption signal flag."""

import os
import random
import signal

import lightning as L
import numpy as np
import pytest
import torch

from lit_pretrain.data.datamodule import GlobalOrderSampler
from lit_pretrain.data.train_loader import TrainLoader
from lit_pretrain.errors import ConfigError
from lit_pretrain.optim.optimizers import build_adamw
from lit_pretrain.resume import rank_state
from lit_pretrain.resume.checkpoint_io import AtomicCheckpointIO
from lit_pretrain.resume.checkpointing import StepCheckpoint
from lit_pretrain.resume.preemption import PreemptionFlag, requeue_slurm_job, resume_command
from lit_pretrain.resume.verified import load_verified, save_atomic
from lit_pretrain.schema import OptimConfig


def draws():
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


def test_rng_state_round_trip_and_world_size_policy():
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    saved = rank_state.capture()
    first = draws()
    rank_state.apply(saved)
    assert draws() == first  # all three generators continue exactly
    states = [saved, rank_state.capture()]
    assert rank_state.pick(states, 1) is states[1]  # same rank, same stream
    extra = rank_state.pick(states, 2)  # a rank the checkpoint did not have: deterministic, not rank 0's stream
    rank_state.apply(extra)
    new_rank = draws()
    rank_state.apply(rank_state.pick(states, 2))
    assert draws() == new_rank and new_rank != first


class Windows(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.tensor([i])


def loader(rank, world, batch):
    return TrainLoader(Windows(), GlobalOrderSampler(64, batch, rank, world, seed=3), batch)


def test_data_position_is_global_across_world_sizes():
    one = loader(0, 1, 8)
    order = [b.flatten().tolist() for b in one]  # 8 micro-batches of 8: the global order
    it = iter(one)
    for _ in range(3):  # three trained micro-batches, one more prefetched and handed out
        next(it)
        one.take_trained_indices()
    next(it)
    state = one.state_dict()
    assert state["trained_samples"] == 24  # 3 × 8; the prefetched batch not yet trained on is not counted
    # 1 → 2 processes: each rank continues its strided share of the same global positions.
    ranks = [loader(r, 2, 4) for r in range(2)]
    for r in ranks:
        r.load_state_dict(state)
    rest = [sorted(a.flatten().tolist() + b.flatten().tolist()) for a, b in zip(*ranks)]
    assert rest == [sorted(x) for x in order[3:]]
    # A position that is not a whole number of the new global micro-batches is refused, naming the keys.
    odd = {**state, "trained_samples": 28}
    with pytest.raises(ConfigError, match="micro_batch_size"):
        ranks[0].load_state_dict(odd)


def test_a_resume_in_a_later_epoch_reads_that_epoch_from_its_position():
    """Lightning creates a resumed run's iterator before it sets the sampler's epoch (FitLoop.setup_data, then
    on_advance_start): the loader reads the checkpoint's epoch, not the fresh sampler's epoch 0. On main the loader
    looked its position up by the sampler's epoch, found none for epoch 0 and read epoch 1 from its start again."""
    one = loader(0, 1, 8)
    epoch1 = one.sampler.global_order(1).tolist()
    resumed = loader(0, 1, 8)
    resumed.load_state_dict({"epoch": 1, "trained_samples": 16, "pending_drop_samples": 0, "dropped": []})
    it = iter(resumed)  # the sampler still says epoch 0, as Lightning leaves it here
    resumed.sampler.set_epoch(1)  # Lightning's on_advance_start, before the first batch is fetched
    assert next(it).flatten().tolist() == epoch1[16:24]
    assert resumed.position() == (1, 16)  # the batch handed out is not trained on yet: the checkpoint's 16
    # An epoch trained to its end (a run that finished on the epoch's last step, then extended): the next epoch.
    done = loader(0, 1, 8)
    done.load_state_dict({"epoch": 0, "trained_samples": 64, "pending_drop_samples": 0, "dropped": []})
    it = iter(done)
    done.sampler.set_epoch(1)
    assert next(it).flatten().tolist() == epoch1[:8]


class _Loader(L.LightningDataModule):
    """The datamodule's interface StepCheckpoint reads, over `Windows`: 64 windows, 8 steps of 8 an epoch."""

    micro_batch_size, seq_len = 8, None

    def __init__(self):
        super().__init__()
        self.train_loader = None

    def rank_and_world_size(self):
        return 0, 1

    def train_dataloader(self):
        self.train_loader = loader(0, 1, self.micro_batch_size)
        return self.train_loader


class _Record(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.seen = []  # (epoch, window indices) of every step

    def training_step(self, batch, batch_idx):
        self.seen.append((self.trainer.current_epoch, batch.flatten().tolist()))
        return (self.w * batch.float().mean()).square()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(folder, max_steps, every_n_steps=0, ckpt_path=None):
    module = _Record()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, use_distributed_sampler=False,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, plugins=[AtomicCheckpointIO(folder)],
                        callbacks=[StepCheckpoint(folder, every_n_steps, keep_last=0, run_meta={},
                                                  handle_signals=False)])
    trainer.fit(module, datamodule=_Loader(), ckpt_path=ckpt_path)
    return module.seen


def test_a_checkpoint_at_the_start_of_an_epochs_last_batch_resumes_that_batch(tmp_path):
    """A step checkpoint is taken at the start of a batch, where Lightning has already marked the epoch's last
    batch as the last; written as "the end of the batch before" it must not say so, or the restart counts the epoch
    as finished: it trained that batch from the next epoch's order and then skipped an epoch (found under expert
    parallelism, whose micro-batch of 8 put step 7 at the end of a 7-step epoch, but any layout whose checkpoint
    falls there did it)."""
    ref = _fit(tmp_path / "ref", max_steps=10, every_n_steps=7)  # checkpoint at the start of step 8, the last
    assert [epoch for epoch, _ in ref] == [0] * 8 + [1] * 2
    resumed = _fit(tmp_path / "resumed", max_steps=10, ckpt_path=tmp_path / "ref" / "step0000007.ckpt")
    assert resumed == ref[7:]
    # A checkpoint written before the flag was cleared (it says the batch before was the epoch's last) is read right
    # too: StepCheckpoint.on_load_checkpoint clears it for its own checkpoints taken at a batch's start.
    old = tmp_path / "old" / "step0000007.ckpt"
    old.parent.mkdir()
    checkpoint = load_verified(tmp_path / "ref" / "step0000007.ckpt")
    checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["is_last_batch"] = True
    save_atomic(checkpoint, old)
    assert _fit(tmp_path / "old", max_steps=10, ckpt_path=old) == ref[7:]


def test_sigterm_and_sigusr1_set_the_flag_and_slurm_requeue(monkeypatch, capsys):
    flag = PreemptionFlag()
    before = signal.getsignal(signal.SIGUSR1)
    flag.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.signum == signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.signum == signal.SIGTERM
    finally:
        flag.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == before
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert requeue_slurm_job() is None
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol here: the failure is reported, not raised
    assert requeue_slurm_job() == "scontrol requeue 4242"
    assert "failed" in capsys.readouterr().out


def test_first_ctrl_c_sets_the_flag_and_the_second_is_sigints_default(monkeypatch):
    """The first SIGINT asks for the checkpoint like SIGTERM; from then on SIGINT is the default action (the process
    ends at once, even inside a collective), also after the flag is uninstalled."""
    flag = PreemptionFlag()
    before = signal.getsignal(signal.SIGINT)
    flag.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert flag.signum == signal.SIGINT
        assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL
        os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's signal after Ctrl-C: its exit code (0) wins
        assert flag.signum == signal.SIGTERM
    finally:
        flag.uninstall()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("argv0, on_path, expected_program", [
    # the README's set-up: `make install` into .venv, not activated; the program as the user typed it
    (".venv/bin/lit-pretrain", False, ".venv/bin/lit-pretrain"),
    ("{repo}/.venv/bin/lit-pretrain", False, ".venv/bin/lit-pretrain"),  # a shell passes it on absolute
    ("{repo}/.venv/bin/lit-pretrain", True, "lit-pretrain"),  # an activated .venv: the bare name finds this file
    ("{elsewhere}/bin/lit-pretrain", False, "{elsewhere}/bin/lit-pretrain"),  # outside the shell's folder
    ("{repo}/lit_pretrain/cli.py", False, ".venv/bin/python -m lit_pretrain.cli"),  # the interpreter that ran it
])
def test_resume_command_is_one_the_user_can_paste(tmp_path, argv0, on_path, expected_program):
    repo, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    for program in (repo / ".venv" / "bin" / "lit-pretrain", repo / ".venv" / "bin" / "python",
                    elsewhere / "bin" / "lit-pretrain"):
        program.parent.mkdir(parents=True, exist_ok=True)
        program.write_text("")
        program.chmod(0o755)
    other = tmp_path / "usr" / "bin"  # another lit-pretrain and python on PATH: not the ones that ran
    other.mkdir(parents=True)
    for name in ("lit-pretrain", "python"):
        (other / name).write_text("")
        (other / name).chmod(0o755)
    search_path = os.pathsep.join([str(repo / ".venv" / "bin")] if on_path else [str(other)])
    argv = [argv0.format(repo=repo, elsewhere=elsewhere), "train", "run.yaml", "run.name=a b",
            "run.resume=/p/step0000002.ckpt", "run.overwrite=true", "k=1"]
    command = resume_command(argv, executable=str(repo / ".venv" / "bin" / "python"), cwd=str(repo),
                             search_path=search_path)
    assert command == f"{expected_program.format(elsewhere=elsewhere)} train run.yaml 'run.name=a b' k=1 " \
                      "run.resume=auto"


def test_allowed_lr_peak_change_takes_effect_on_the_restored_schedule():
    from types import SimpleNamespace

    from lit_pretrain.resume.session import NewLrPeak

    optimizer = build_adamw(torch.nn.Linear(1, 1, bias=False), OptimConfig(lr_peak=1e-3))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 / 4)
    # Restored state holds the old peak as base rate; the callback sets the new one and the coming step's rate.
    trainer = SimpleNamespace(lr_scheduler_configs=[SimpleNamespace(scheduler=scheduler)])
    NewLrPeak(2e-3).on_train_start(trainer, None)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2e-3 / 4)
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2e-3 / 5)
