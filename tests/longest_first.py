"""The order `make test` hands tests to its pytest-xdist workers: each worker's queue starts with its share of the
long tests, longest first, and ends with short ones.

Why: `--dist worksteal` gives worker k the k-th contiguous slice of the collected order, and an idle worker steals
the tail of the other's queue. In file order a 100 s test can start last and hold the run open alone; balanced
long tests at the heads of the queues and short ones at their tails leave the tail to small, stealable pieces.

Durations come from the last run on this checkout (pytest's cache, `lit_pretrain/durations`: setup + call +
teardown of each test, refreshed by every run, partial ones too), else from KNOWN (measured with `make test` on 2
idle cores). Without xdist the order is unchanged: one process runs everything either way.
"""

from __future__ import annotations

import pytest

CACHE_KEY = "lit_pretrain/durations"
LONG = 5.0  # seconds: tests at least this long are placed; shorter ones keep their file order (their fixtures too)

# Seconds under `make test` (2 workers) on 2 idle cores, for a checkout whose cache holds none yet: the last full run's,
# and for the tests split since, their parts measured alone and scaled to it. Node ids as pytest prints them.
BATCH = "tests/test_batch.py::test_six_layouts_of_one_config_train_the_same_tokens"
KNOWN = {
    f"{BATCH}[pp2]": 16.0, f"{BATCH}[ep2]": 13.0, f"{BATCH}[tp2]": 12.0, f"{BATCH}[zero3_2]": 10.0,
    f"{BATCH}[ddp2]": 9.0, f"{BATCH}[single]": 8.5,
    "tests/test_mesh_strategy.py::test_muon_checkpoint_resumes_under_tensor_parallelism": 12.0,
    "tests/test_resume.py::test_ddp_sigkill_twice_and_world_size_changes": 70.0,
    "tests/test_resume.py::test_zero3_resumes_the_ddp_sharded_folder_and_sigkill": 40.0,
    "tests/test_resume.py::test_zero3_tensor_parallel_resume_from_single_process_and_sigkill": 62.9,
    "tests/test_resume.py::test_single_process_sigkill_twice_sigterm_and_ctrl_c": 33.1,
    "tests/test_moe_parallel.py::test_expert_parallel_resumes_bitwise_after_sigkill_mid_accumulation": 49.1,
    "tests/test_fault_tolerance.py::test_killed_rank_ends_the_job_and_the_restart_is_bitwise": 41.1,
    "tests/test_mesh_strategy.py::test_checkpoint_resumes_in_another_layout": 30.0,
    "tests/test_strategies_parity.py::test_per_rank_bytes_follow_the_shard_sizes": 36.3,
    "tests/test_expert_parallel.py::test_four_process_expert_parallelism_in_every_plan_matches_one_process": 34.8,
    "tests/test_mesh_strategy.py::test_tensor_and_pipeline_train_from_config_like_one_process": 32.8,
    "tests/test_bf16.py::test_compiled_step_under_bf16_autocast_matches_eager": 32.2,
    "tests/test_pretokenized_train.py::test_mixture_with_a_megatron_source_resumes_bitwise_after_sigkill": 28.1,
    "tests/test_multinode.py::test_two_torchrun_nodes_train_bitwise_one_node_of_two[ddp]": 26.3,
    "tests/test_multinode.py::test_two_torchrun_nodes_train_bitwise_one_node_of_two[zero3]": 21.9,
}


def _seconds(config) -> dict:
    cached = config.cache.get(CACHE_KEY, None) if getattr(config, "cache", None) else None
    return {**KNOWN, **cached} if cached else dict(KNOWN)


def _slice_sizes(n: int, workers: int) -> list:
    """How many tests worksteal's first schedule sends each worker: an even share of what is still pending, worker
    by worker (xdist/scheduler/worksteal.py, check_schedule)."""
    sizes, left = [], n
    for i in range(workers):
        sizes.append(left // (workers - i))
        left -= sizes[-1]
    return sizes


def order(items: list, seconds: dict, workers: int) -> list:
    """`items` reordered as `workers` consecutive slices of worksteal's sizes: the long tests dealt to the slice with
    the least long-test seconds so far (longest first), at its head; the short ones, in file order, fill the slices
    up to their sizes."""
    if workers < 2:
        return items
    duration = {item.nodeid: seconds.get(item.nodeid, 0.0) for item in items}
    long = sorted((i for i in items if duration[i.nodeid] >= LONG), key=lambda i: -duration[i.nodeid])
    short = [i for i in items if duration[i.nodeid] < LONG]
    sizes = _slice_sizes(len(items), workers)
    heads, load = [[] for _ in sizes], [0.0] * workers
    for item in long:
        open_slices = [k for k in range(workers) if len(heads[k]) < sizes[k]]
        k = min(open_slices, key=lambda j: load[j])
        heads[k].append(item)
        load[k] += duration[item.nodeid]
    out, start = [], 0
    for k, head in enumerate(heads):
        fill = sizes[k] - len(head)
        out += head + short[start:start + fill]
        start += fill
    assert len(out) == len(items) and {id(i) for i in out} == {id(i) for i in items}
    return out


def workers(config) -> int:
    """The xdist worker count of this session as seen from a worker (0 outside xdist or on the controller)."""
    workerinput = getattr(config, "workerinput", None)
    return int(workerinput["workercount"]) if workerinput else 0


class LongestFirst:
    """The plugin: orders the collection on each worker (each orders the same items alike, as xdist requires) and
    records each test's seconds on the controller (or a plain session), stored in the cache at the end."""

    def __init__(self, config):
        self.config, self.totals = config, {}

    @pytest.hookimpl(trylast=True)  # after -m and -k deselect: the slices are of the tests that run
    def pytest_collection_modifyitems(self, items):
        items[:] = order(items, _seconds(self.config), workers(self.config))

    def pytest_runtest_logreport(self, report):
        if getattr(self.config, "workerinput", None) is None:  # a worker's reports reach the controller too
            self.totals[report.nodeid] = self.totals.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self):
        if self.totals and getattr(self.config, "cache", None) is not None:
            old = self.config.cache.get(CACHE_KEY, None) or {}
            self.config.cache.set(CACHE_KEY, {**old, **{k: round(v, 2) for k, v in self.totals.items()}})
