"""`python -m tests.helpers.measure_failures [REPEATS]`: the figures of README's "Failures on many nodes", measured on
real 2-process `lit-pretrain train` runs of the tiny model (Lightning's launcher, gloo, default watchdog timeouts):

- death → exit: from a fault injected into one rank (tests/helpers/failure_helpers.py RankFault, the time its marker
  file was made) to the moment no process of the run is left (its session scanned every 50 ms);
- restart → first resumed step: from the supervisor's restart line to the first step the restarted run completes
  (StepClock), and how much of it is the new processes' start (to the "resuming from" line).
"""

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tests.conftest import EXPERIMENTS, tiny_data_overrides
from tests.launch.test_fault_tolerance import DDP, Job, session_processes

COMMON = ["trainer.max_steps=6", "trainer.val_every_n_steps=3", "trainer.log_every_n_steps=1",
          "schedule.warmup_steps=2", "trainer.checkpoint_every_n_steps=2", "trainer.progress_bar=false",
          "trainer.val_windows=8"]


def start(data: Path, root: Path, name: str, *overrides, faults=()) -> Job:
    specs = [{"class_path": "tests.helpers.failure_helpers:StepClock"}, *faults]
    return Job("lit_pretrain.cli", "train", str(EXPERIMENTS / "runs" / "tiny.yaml"), *tiny_data_overrides(data),
               f"run.root_dir={root}", f"run.name={name}", *COMMON, *DDP, *overrides,
               f"callbacks.extra=[{', '.join(json.dumps(f) for f in specs)}]")


def gone_after(job: Job, marker: Path) -> float:
    """Seconds from the fault (marker's time) until no process of the job's session is left."""
    while True:
        if job.proc.poll() is not None and not session_processes(job.proc.pid):
            end = time.time()
            job.wait()
            return end - marker.stat().st_mtime
        time.sleep(0.05)


def main(repeats: int) -> None:
    data = Path(sys.argv[2]) if len(sys.argv) > 2 else None
    root = Path(tempfile.mkdtemp(prefix="measure_failures_"))
    if data is None:
        from lit_pretrain import config
        from lit_pretrain.data.preparation.prepare import prepare

        data = root / "data"
        prepare(config.to_object(config.load(EXPERIMENTS / "runs" / "tiny.yaml", tiny_data_overrides(data))).data,
                log=lambda *_: None)
    results = {}
    for case, rank, action in (("rank 1 SIGKILL", 1, "KILL"), ("rank 0 SIGKILL", 0, "KILL"),
                               ("rank 1 SIGSTOP", 1, "STOP")):
        times = []
        for i in range(repeats):
            marker = root / f"{action}{rank}-{i}.fault"
            fault = {"class_path": "tests.helpers.failure_helpers:RankFault",
                     "init_args": {"step": 3, "rank": rank, "action": action, "once": str(marker)}}
            job = start(data, root, f"{action}{rank}-{i}", faults=[fault])
            times.append(round(gone_after(job, marker), 2))
            assert len(job.matching("^watchdog: ")) == 1, job.text()[-3000:]
        results[case] = times
        print(f"{case}: death → whole job gone {statistics.median(times):.2f} s (median of {times})", flush=True)
    restart, startup = [], []
    for i in range(repeats):
        marker = root / f"restart-{i}.fault"
        fault = {"class_path": "tests.helpers.failure_helpers:RankFault",
                 "init_args": {"step": 3, "rank": 1, "once": str(marker)}}
        job = start(data, root, f"restart-{i}", "run.max_restarts=1", faults=[fault])
        assert job.wait() == 0, job.text()[-3000:]
        relaunch = job.matching(r"^supervisor: attempt 1 failed")[0][0]
        resumed = job.matching(r"^resuming from")[0][0]
        first = next(float(line.split()[2]) for t, line in job.lines if line.startswith("step-clock") and t > relaunch)
        restart.append(round(first - relaunch, 2))
        startup.append(round(resumed - relaunch, 2))
    print(f"restart → first resumed step {statistics.median(restart):.2f} s (median of {restart}); of which "
          f"start-up to the resume line {statistics.median(startup):.2f} s ({startup})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
