"""Peer watchdog: a rank that dies, stops or hangs ends the whole job within strategy.peer_failure_timeout_seconds
(a hang: strategy.hang_timeout_seconds) with one line naming the rank and its step, instead of peers waiting in a
collective for strategy.timeout_seconds or printing pages of gloo/NCCL tracebacks.

Each rank runs a thread beside training (the heartbeats of torchft and of Megatron's in-process restart, in a few
lines): every `interval` it writes a heartbeat (a counter, its step and micro-batch progress, pid, host) into the
rendezvous TCPStore the process group already uses (MASTER_ADDR:MASTER_PORT, through a client of its own) and reads
the next rank's (a ring: O(world) store traffic, not O(world²)). That peer has failed when
- its process is gone (on this host: /proc/<pid> missing or a zombie; seen at the next beat), or
- its heartbeat has not changed for peer_failure_timeout_seconds (SIGSTOPped, killed on another node, node lost: a
  stopped process beats no more; clocks of different nodes are never compared, only whether a value changes), or
- the store itself stays unreachable that long (it lives in rank 0's process under Lightning's launcher, in node
  0's agent under torchrun): rank 0 or its node is gone.
A rank that has left training normally first sets its `done` key, so its exit is no failure. Rank 0 also watches
progress: every rank alive but no micro-batch count moved for hang_timeout_seconds is a hang, and the ranks with the
lowest count are behind.

The first rank to see a failure publishes a verdict (compare_set: exactly one wins); every rank acts on that one: on
a hang each dumps its Python stacks (faulthandler, all threads) to <run>/stacks/rank<r>.txt; the lowest living rank
prints the line and SIGKILLs the failed ranks it can reach on its host (a stopped process never exits by itself);
every rank leaves with os._exit(EXIT_PEER_FAILURE): no teardown that could wait on the dead peer again. A collective
that fails in the main thread meanwhile (gloo sees a reset connection at once) waits for the verdict instead of
printing its traceback (WatchdogCallback.on_exception).
"""

import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Dict, Optional

from lightning.pytorch.callbacks import Callback

from lit_pretrain.launch.launcher import kill_children

EXIT_PEER_FAILURE = 3
"""Exit code of every rank the watchdog ends (2 stays the config errors' code)."""
STACKS = "stacks"


def proc_state(pid: int, start: Optional[str] = None) -> Optional[str]:
    """The state letter (R, S, D, T, Z, ...) of process `pid` on this host, or None when it is gone or the pid now
    belongs to a process started at another time than `start` (field 22 of /proc/<pid>/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # fields[0] is field 3 (state), fields[19] field 22 (start time)
    if start is not None and fields[19] != start:
        return None
    return fields[0]


def _own_start() -> str:
    stat = Path(f"/proc/{os.getpid()}/stat").read_text()
    return stat[stat.rindex(")") + 2:].split()[19]


class Watchdog:
    def __init__(self, rank: int, world: int, run_dir: Path, peer_timeout: float, hang_timeout: float,
                 address: tuple, prefix: str = "lit_pretrain/watchdog/"):
        self.rank, self.world, self.run_dir = rank, world, Path(run_dir)
        self.peer_timeout, self.hang_timeout = peer_timeout, hang_timeout
        self.interval = min(1.0, peer_timeout / 5)
        self.address, self.prefix = address, prefix
        self.step = self.progress = 0  # written by the main thread (WatchdogCallback)
        self.host, self.pid, self.start_time = socket.gethostname(), os.getpid(), _own_start()
        # torchrun's agent holds the store its workers use (TORCHELASTIC_USE_AGENT_STORE); otherwise rank 0 does.
        self.store_in_rank0 = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        self.stopped = threading.Event()
        self.acting = threading.Event()
        self.beats = 0
        self.seen: Dict[int, dict] = {}  # the last heartbeat read of each peer

    def key(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def start(self) -> None:
        from torch.distributed import TCPStore

        # A short client timeout: a store whose process is stopped must not block the watchdog for minutes.
        self.store = TCPStore(self.address[0], int(self.address[1]), is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=max(2.0, 2 * self.interval)))
        self.beat()
        if self.rank != 0:
            # Rank 0's heartbeat (its pid, host) before training: the one this rank names if the store goes with
            # it. Every rank starts here within moments (Lightning's barrier before the setup hooks).
            try:
                self.store.wait([self.key("beat/0")], timedelta(seconds=self.peer_timeout))
                self.seen[0] = self.read(0)
            except Exception:
                pass  # rank 0 slow to start: its heartbeat is read by the thread later
        threading.Thread(target=self.run, daemon=True, name="lit-pretrain-watchdog").start()

    def finish(self) -> None:
        """Training left normally on this rank: say so (a peer that sees this process gone is then not alarmed)."""
        self.stopped.set()
        try:
            self.store.set(self.key(f"done/{self.rank}"), "1")
        except Exception:  # the store may already be gone at the end of a run: nothing to tell then
            pass

    def beat(self) -> None:
        self.beats += 1
        self.store.set(self.key(f"beat/{self.rank}"), json.dumps(
            {"n": self.beats, "step": self.step, "progress": self.progress, "pid": self.pid, "host": self.host,
             "start": self.start_time}))

    def read(self, rank: int) -> Optional[dict]:
        if not self.store.check([self.key(f"beat/{rank}")]):
            return None
        return json.loads(self.store.get(self.key(f"beat/{rank}")))

    def run(self) -> None:
        watched = (self.rank + 1) % self.world
        now = time.monotonic()
        changed = {watched: now}  # when the watched heartbeat last changed (local clock only)
        reachable, lost = now, False
        progress_view, progress_since = None, now
        while True:
            now = time.monotonic()
            failure = None
            # A store connection that broke never comes back (TCPStore does not reconnect), and every further
            # operation on it prints a C++ warning with a backtrace: after a broken connection, or once the
            # store's holder (rank 0's process, unless torchrun's agent holds it) is gone from this host, no more
            # operations, only the wait for a normal end (`finish`) or the peer timeout.
            lost = lost or (self.store_in_rank0 and self.rank != 0 and self.holder_gone())
            if not lost:
                try:
                    failure = self.tick(watched, now, changed)
                    if failure is None and self.rank == 0 and self.hang_timeout:
                        counts_view = self.progress_view()
                        if counts_view is not None:
                            counts, view = counts_view
                            if counts != progress_view:
                                progress_view, progress_since = counts, now
                            elif now - progress_since > self.hang_timeout:
                                failure = self.hang(view, counts, now - progress_since)
                    reachable = now
                except Exception as err:  # the store unreachable: its holder gone or stopped, or the run ending
                    lost = any(w in str(err) for w in ("Broken pipe", "reset", "refused", "closed"))
            if self.stopped.is_set():
                return
            if now - reachable > self.peer_timeout:
                return self.store_lost(now - reachable)
            if failure is not None:
                return self.publish(failure)
            if self.stopped.wait(self.interval):
                return

    def tick(self, watched: int, now: float, changed: Dict[int, float]) -> Optional[dict]:
        """One heartbeat: write this rank's, act on a verdict, read the watched rank's (and rank 0's); a failure
        found, or None."""
        self.beat()
        if self.store.check([self.key("verdict")]):
            self.act(json.loads(self.store.get(self.key("verdict"))))
        for rank in {watched, 0} - {self.rank}:  # rank 0's beat too: its pid and step if the store goes
            beat = self.read(rank)
            if beat is not None and beat != self.seen.get(rank):
                self.seen[rank], changed[rank] = beat, now
        return self.judge(watched, now - changed[watched])

    def progress_view(self):
        """(micro-batch counts, heartbeats) of every rank, once all have beaten (one request for all)."""
        keys = [self.key(f"beat/{r}") for r in range(self.world)]
        if not self.store.check(keys):
            return None
        view = [json.loads(v) for v in self.store.multi_get(keys)]
        return [b["progress"] for b in view], view

    def holder_gone(self) -> bool:
        """Rank 0's process, on this host, is gone or stopped (each operation on its store would fail or time
        out, each with a C++ warning)."""
        beat = self.seen.get(0)
        return beat is not None and beat["host"] == self.host and proc_state(beat["pid"], beat["start"]) in (
            None, "Z", "X", "T", "t")

    def judge(self, rank: int, silent_for: float) -> Optional[dict]:
        beat = self.seen.get(rank)
        state = proc_state(beat["pid"], beat["start"]) if beat and beat["host"] == self.host else "?"
        gone = state is None or state in ("Z", "X")
        if not gone and silent_for <= self.peer_timeout:
            return None
        if self.store.check([self.key(f"done/{rank}")]):
            return None  # it finished training and left
        where = f" (pid {beat['pid']} on {beat['host']})" if beat else ""
        # Its last heartbeat may be up to an interval old; the ranks step together, so this rank's step (waiting
        # for it in that step's collective) is the step it failed in.
        step = max(beat["step"] if beat else 0, self.step)
        if gone:
            why = "died"
        elif state in ("T", "t"):
            why = (f"is stopped (no heartbeat for {silent_for:.1f} s, strategy.peer_failure_timeout_seconds="
                   f"{self.peer_timeout:g})")
        else:
            why = (f"sent no heartbeat for {silent_for:.1f} s (strategy.peer_failure_timeout_seconds="
                   f"{self.peer_timeout:g}): its process or node is lost")
        return {"ranks": [rank], "step": step, "kill": [beat] if beat and not gone else [],
                "line": f"watchdog: rank {rank}{where} {why} at step {step}: ending the job"}

    def hang(self, view, counts, stalled: float) -> dict:
        low = min(counts)
        behind = [r for r, c in enumerate(counts) if c == low]
        step = view[behind[0]]["step"] if view[behind[0]] else 0
        if len(behind) == self.world:
            who = f"every rank is stuck at step {step} (micro-batch count {low})"
        else:
            names = ", ".join(map(str, behind))
            who = (f"{'ranks ' + names + ' are' if len(behind) > 1 else 'rank ' + names + ' is'} behind at step "
                   f"{step} (micro-batch count {low}, the others at {max(counts)})")
        return {"ranks": [], "step": step, "kill": [], "hang": True,
                "line": f"watchdog: {who}; no rank progressed for {stalled:.0f} s (strategy.hang_timeout_seconds="
                        f"{self.hang_timeout:g}); each rank's Python stack is in {self.run_dir / STACKS}/: ending "
                        "the job"}

    def publish(self, failure: dict) -> None:
        won = self.store.compare_set(self.key("verdict"), "", json.dumps(failure))
        self.act(json.loads(won))

    def act(self, verdict: dict) -> None:
        """Every rank, on the one verdict: stacks (a hang), the line (the lowest living rank), then exit."""
        self.acting.set()
        if verdict.get("hang"):
            self.dump_stacks()
        reporter = min(r for r in range(self.world) if r not in verdict["ranks"])
        try:
            if self.rank == reporter:
                # After every living rank's acknowledgement (its stack file is written), at most a few seconds.
                acks = [self.key(f"ack/{r}") for r in range(self.world) if r not in verdict["ranks"] + [self.rank]]
                if acks:
                    self.store.wait(acks, timedelta(seconds=max(5.0, self.peer_timeout)))
                print(verdict["line"], file=sys.stderr, flush=True)
                for beat in verdict["kill"]:
                    if beat["host"] == self.host and proc_state(beat["pid"], beat["start"]) is not None:
                        os.kill(beat["pid"], signal.SIGKILL)
                self.store.set(self.key("reported"), "1")
            else:
                self.store.set(self.key(f"ack/{self.rank}"), "1")
                # The reporter may hold the store (rank 0): leave only once it has printed.
                self.store.wait([self.key("reported")], timedelta(seconds=max(5.0, self.peer_timeout)))
        except Exception:
            pass  # a store gone meanwhile: leave anyway
        self.exit()

    def store_lost(self, for_seconds: float) -> None:
        """No verdict can be shared without the store: the ranks on this host that see it gone claim one name in
        the abstract socket namespace (released when the process ends), so one of them reports rank 0 (the store's
        holder) and the others leave quietly."""
        self.acting.set()
        beat = self.seen.get(0)
        state = proc_state(beat["pid"], beat["start"]) if beat and beat["host"] == self.host else "?"
        claim = socket.socket(socket.AF_UNIX)
        try:
            claim.bind(f"\0lit-pretrain-watchdog-{self.address[0]}-{self.address[1]}-{self.prefix}")
        except OSError:
            self.exit()  # another rank on this host reports it
        what = {None: "died", "Z": "died", "T": "is stopped", "t": "is stopped"}.get(state, "or its node is gone")
        where = f" (pid {beat['pid']} on {beat['host']})" if beat else ""
        step = max(beat["step"] if beat else 0, self.step)
        print(f"watchdog: rank {self.rank} lost the rendezvous store at {self.address[0]}:{self.address[1]} for "
              f"{for_seconds:.1f} s: rank 0{where}, which holds it, {what} at step {step}: ending the job",
              file=sys.stderr, flush=True)
        if beat and state in ("T", "t"):
            os.kill(beat["pid"], signal.SIGKILL)
        time.sleep(self.interval + 0.25)  # the other ranks see the store gone within an interval: hold the claim
        self.exit()

    def dump_stacks(self) -> None:
        folder = self.run_dir / STACKS
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"rank{self.rank}.txt", "w") as f:
            f.write(f"rank {self.rank}, pid {self.pid} on {self.host}, step {self.step}, micro-batch count "
                    f"{self.progress}\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)

    def exit(self) -> None:
        kill_children(wait_seconds=2.0)  # local ranks this process launched that are still running
        sys.stdout.flush()
        os._exit(EXIT_PEER_FAILURE)

    def wait_for_verdict(self) -> None:
        """In the main thread, after a collective failed: give the watchdog time to name the failed rank (it exits
        the process); return when it found nothing, so the error is raised as it is."""
        deadline = time.monotonic() + self.peer_timeout + 3 * self.interval + 2.0
        while time.monotonic() < deadline or self.acting.is_set():
            time.sleep(0.05)


class WatchdogCallback(Callback):
    """Starts the watchdog once the process group exists, feeds it each rank's step and progress, stops it when
    training ends, and holds a failed collective's exception until the watchdog has named the failed rank."""

    def __init__(self, run_dir: Path, peer_timeout: float, hang_timeout: float):
        self.run_dir, self.peer_timeout, self.hang_timeout = Path(run_dir), peer_timeout, hang_timeout
        self.watchdog: Optional[Watchdog] = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit" or trainer.world_size < 2 or self.watchdog is not None:
            return
        env = trainer.strategy.cluster_environment  # torchrun's, SLURM's or Lightning's: where the store listens
        address = (env.main_address, env.main_port)
        # torchrun keeps its agent's store across restarts: keys of an earlier attempt must not be read as this one's.
        prefix = f"lit_pretrain/watchdog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self.watchdog = Watchdog(trainer.global_rank, trainer.world_size, self.run_dir, self.peer_timeout,
                                 self.hang_timeout, address, prefix)
        self.watchdog.start()

    def _progress(self, trainer) -> None:
        if self.watchdog is not None:
            self.watchdog.step = trainer.global_step
            self.watchdog.progress += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._progress(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._progress(trainer)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._progress(trainer)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._progress(trainer)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit" and self.watchdog is not None:
            self.watchdog.finish()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # DistBackendError, DistNetworkError and gloo's own errors are RuntimeErrors; any other exception is this
        # rank's own and raised at once (a peer's watchdog names this rank then).
        if self.watchdog is not None and isinstance(exception, RuntimeError):
            self.watchdog.wait_for_verdict()
