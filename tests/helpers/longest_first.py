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

# Seconds under `make test` (3 workers) on 2 idle cores, for a checkout whose cache holds none yet (a clean clone,
# as CI runs): every test of at least LONG seconds in the clean-clone `.ci/run` of 8ac222a (1,154 tests, pytest
# 601 s; setup + call + teardown). Node ids as pytest prints them.
KNOWN = {
    "tests/resume/test_resume.py::test_ddp_sigkill_twice_and_world_size_changes": 73.0,
    "tests/launch/test_fault_tolerance.py::test_killed_rank_ends_the_job_and_the_restart_is_bitwise": 60.4,
    "tests/resume/test_resume.py::test_single_process_sigkill_twice_sigterm_and_ctrl_c": 60.3,
    "tests/resume/test_resume.py::test_zero3_tensor_parallel_resume_from_single_process_and_sigkill": 59.2,
    "tests/parallel/test_bf16.py::test_bf16_mixed_clips_fp32_gradients_by_their_fp32_norm": 58.5,
    "tests/parallel/test_expert_parallel.py::"
    "test_four_process_expert_parallelism_in_every_plan_matches_one_process": 47.5,
    # 52.9 s with the whole grid of starts; with coarse_fit_grid 203 s where the whole grid's ran 227 s beside it (a
    # loaded machine): scaled by that ratio. The signal test below alike: 26.8 s, 28 s against 42 s.
    "tests/scaling/test_ladder.py::test_a_killed_ladder_resumes_rung_by_rung": 47.3,
    "tests/resume/test_resume.py::test_context_parallel_zero3_resume_from_single_process_and_sigkill": 47.2,
    "tests/parallel/test_mesh_parallel.py::test_four_process_layouts_match_one_process": 43.3,
    "tests/launch/test_multinode.py::test_two_torchrun_nodes_train_bitwise_one_node_of_two[ddp]": 40.4,
    "tests/strategy/test_strategies_parity.py::test_per_rank_bytes_follow_the_shard_sizes": 39.1,
    "tests/strategy/test_strategies_parity.py::test_memory_planner_agrees_with_the_measured_bytes": 32.9,
    "tests/launch/test_multinode.py::test_two_torchrun_nodes_train_bitwise_one_node_of_two[zero3]": 28.0,
    "tests/parallel/test_moe_parallel.py::test_expert_parallel_resumes_bitwise_after_sigkill_mid_accumulation": 24.4,
    "tests/callbacks/test_stability_train.py::test_clean_run_has_no_events": 23.7,
    "tests/data/test_pretokenized_train.py::test_mixture_with_a_megatron_source_resumes_bitwise_after_sigkill": 23.1,
    "tests/strategy/test_mesh_strategy.py::test_tensor_and_pipeline_train_from_config_like_one_process": 22.9,
    "tests/strategy/test_mesh_strategy.py::test_checkpoint_resumes_in_another_layout": 22.8,
    "tests/parallel/test_moe_mesh.py::test_four_process_moe_layouts_match_one_process": 22.4,
    # 26.3 s with the whole grid of starts; with coarse_fit_grid 35.7 CPU s alone where the whole grid took 42.1.
    "tests/scaling/test_scaling_cli.py::test_sweep_trains_fits_predicts_and_reports": 22.3,
    "tests/resume/test_resume.py::test_zero3_resumes_the_ddp_sharded_folder_and_sigkill": 20.3,
    "tests/scaling/test_ladder.py::test_a_signal_stops_the_ladder_at_a_checkpoint_and_the_next_call_continues": 17.9,
    # The layout chains (tests/test_transitions.py), by `make test` on another 2-core machine (AMD EPYC, AVX2 only)
    # that ran the whole suite at about 1.5x these figures: 112, 85 and 54 s, scaled by 1/1.5.
    "tests/test_transitions.py::test_layout_chain_equals_the_uninterrupted_run[a]": 75.0,
    "tests/test_transitions.py::test_layout_chain_equals_the_uninterrupted_run[c]": 57.0,
    "tests/test_transitions.py::test_layout_chain_equals_the_uninterrupted_run[b]": 36.0,
    "tests/test_user_code.py::"
    "test_a_callback_that_stops_the_run_is_recorded_as_the_stop_it_is[{step: 7, bare: true}-stopped-reason1]": 24.0,
    # Measured alone (pytest -k) on a loaded 2-core machine, not by `make test`: 34-39 s.
    "tests/resume/test_resume.py::test_one_file_checkpoints_resume_under_zero2_and_zero3": 36.0,
    "tests/parallel/test_moe_parallel.py::"
    "test_moe_under_data_parallelism_and_expert_parallelism_matches_one_process[ddp]": 19.5,
    "tests/parallel/test_expert_parallel.py::test_two_process_expert_parallelism_matches_one_process": 18.9,
    "tests/data/test_ray_engine.py::test_ray_engine_writes_the_local_engines_folder[2-False]": 18.9,
    "tests/parallel/test_mesh_parallel.py::test_two_process_layouts_match_one_process": 17.6,
    "tests/launch/test_fault_tolerance.py::test_a_run_failing_at_the_same_step_stops_after_max_restarts": 17.1,
    "tests/parallel/test_context_extension.py::"
    "test_stage_continues_weights_and_the_next_unseen_token_across_a_sigkill": 16.9,
    "tests/parallel/test_mixed_precision.py::test_the_policy_trains_as_the_autocast_path_over_200_steps": 16.8,
    "tests/scaling/test_scaling_fit.py::test_bootstrap_spread_matches_epochs_standard_errors": 16.6,
    "tests/launch/test_fault_tolerance.py::test_sigterm_to_the_supervisor_checkpoints_and_is_not_restarted": 16.0,
    "tests/resume/test_sharded_checkpoint.py::test_two_process_reshard_matrix": 15.7,
    "tests/launch/test_multinode.py::test_two_torchrun_nodes_without_num_nodes_refuse_to_start": 15.6,
    "tests/strategy/test_strategies_parity.py::test_strategy_matches_one_process[zero2]": 15.0,
    "tests/callbacks/test_stability_ddp.py::test_spike_on_one_rank_makes_every_rank_rewind_the_same[zero3_tp2]": 14.3,
    "tests/parallel/test_ddp.py::"
    "test_validation_is_one_set_of_windows_for_any_world_size_and_the_console_holds_our_lines": 14.2,
    "tests/bench/test_bench_history.py::test_gpu_bench_dry_run_of_a_preset_fits_it_to_the_device": 13.7,
    # 29.2 s with the whole grid of starts; its law fits from every 11th (tests/conftest.py coarse_fit_grid) took
    # 26.1 CPU s alone where the whole grid took 55.6: 29.2 s scaled by that ratio (pytest's start is in both).
    "tests/scaling/test_ladder.py::"
    "test_a_law_in_steps_is_fitted_beside_the_law_in_tokens_and_the_development_rung_chooses": 13.7,
    "tests/test_fuzz_config.py::test_cli_process_exits_2_without_traceback": 12.8,
    "tests/data/test_pretokenized_train.py::test_megatron_corpus_trains_the_prepared_folders_losses_bitwise": 12.8,
    "tests/launch/test_strategies_launch.py::test_torchrun_runs_the_train_command_unchanged": 12.7,
    "tests/resume/test_sharded_checkpoint.py::test_four_process_reshard_to_and_from_one_process": 12.6,
    "tests/parallel/test_moe_parallel.py::"
    "test_moe_under_data_parallelism_and_expert_parallelism_matches_one_process[ep2_aux_global]": 12.4,
    "tests/bench/test_bench_history.py::test_gpu_bench_dry_run_runs_the_code_path_on_cpu": 12.4,
    "tests/parallel/test_moe_mesh.py::test_moe_trains_through_the_cli_under_the_mesh[cp2_ep2]": 11.9,
    "tests/test_fuzz_config.py::test_broken_configs_give_one_line_naming_the_key": 11.8,
    "tests/data/test_ray_engine.py::test_an_unreachable_ray_address_is_exit_2_and_one_line": 11.8,
    "tests/evaluation/test_evaluation.py::test_downstream_eval_under_zero_stage_3_gathers_the_weights_to_rank_0": 11.7,
    "tests/data/test_ray_engine.py::test_ray_engine_writes_the_local_engines_folder[1-True]": 11.6,
    "tests/parallel/test_bf16.py::test_bf16_mixed_trains_to_the_fp32_loss": 11.4,
    "tests/strategy/test_strategies_parity.py::test_strategy_matches_one_process[zero1]": 10.3,
    "tests/parallel/test_moe_mesh.py::test_moe_trains_through_the_cli_under_the_mesh[ep2_pp2]": 10.2,
    "tests/scaling/test_scaling_fit.py::"
    "test_chinchilla_data_recovers_epoch_coefficients_within_their_uncertainty": 10.2,
    "tests/launch/test_fault_tolerance.py::test_killed_rank_0_is_reported_by_its_peer": 10.1,
    "tests/callbacks/test_stability_train.py::"
    "test_rewind_restores_the_rewind_point_and_skips_exactly_the_configured_batches[2]": 10.0,
    "tests/parallel/test_moe_parallel.py::"
    "test_moe_under_data_parallelism_and_expert_parallelism_matches_one_process[ep2]": 10.0,
    "tests/launch/test_fault_tolerance.py::test_hung_rank_is_named_with_every_ranks_stack": 9.9,
    "tests/parallel/test_float8.py::"
    "test_each_recipe_trains_like_bf16_for_200_steps_and_its_checkpoint_is_a_plain_one": 9.3,
    "tests/planning/test_batch.py::test_six_layouts_of_one_config_train_the_same_tokens[tp2]": 9.3,
    "tests/strategy/test_strategies_parity.py::test_optimizer_state_is_consolidated_into_the_checkpoint[zero3]": 9.3,
    "tests/data/test_ray_engine.py::test_a_killed_worker_is_replaced_and_the_output_is_unchanged": 9.2,
    "tests/parallel/test_moe_parallel.py::"
    "test_moe_under_data_parallelism_and_expert_parallelism_matches_one_process[zero3]": 9.2,
    "tests/planning/test_batch.py::test_six_layouts_of_one_config_train_the_same_tokens[ddp2]": 9.1,
    "tests/planning/test_batch.py::test_six_layouts_of_one_config_train_the_same_tokens[pp2]": 9.0,
    "tests/callbacks/test_stability_ddp.py::test_spike_on_one_rank_makes_every_rank_rewind_the_same[ddp]": 9.0,
    "tests/parallel/test_moe_mesh.py::test_moe_trains_through_the_cli_under_the_mesh[tp2_sp]": 9.0,
    "tests/parallel/test_moe_parallel.py::"
    "test_moe_under_data_parallelism_and_expert_parallelism_matches_one_process[ep2_zero3]": 8.9,
    "tests/strategy/test_strategies_parity.py::test_load_from_checkpoint_under_every_strategy[ddp]": 8.8,
    "tests/test_train.py::test_tiny_fit_learns_and_fills_the_run_folder": 8.8,
    "tests/parallel/test_moe_mesh.py::test_two_process_moe_layouts_match_one_process": 8.3,
    "tests/launch/test_fault_tolerance.py::test_stopped_rank_ends_the_job_and_nothing_is_left": 8.2,
    "tests/callbacks/test_stability_ddp.py::test_spike_on_one_rank_makes_every_rank_rewind_the_same[zero3]": 8.2,
    "tests/parallel/test_bf16.py::test_compiled_step_under_bf16_autocast_matches_eager": 8.0,
    "tests/callbacks/test_stability_ddp.py::test_spike_on_one_rank_makes_every_rank_rewind_the_same[zero1]": 7.8,
    "tests/launch/test_fault_tolerance.py::"
    "test_a_rank_that_never_starts_ends_the_start_within_the_startup_timeout": 7.5,
    "tests/planning/test_batch.py::test_six_layouts_of_one_config_train_the_same_tokens[single]": 7.2,
    "tests/parallel/test_float8.py::test_compiled_fp8_step_is_the_eager_one": 7.2,
    "tests/planning/test_batch.py::test_six_layouts_of_one_config_train_the_same_tokens[zero3_2]": 7.1,
    "tests/parallel/test_mesh_parallel.py::test_eight_process_zero3_tp2_pp2_matches_one_process": 7.1,
    "tests/parallel/test_mixed_precision.py::test_the_policy_halves_the_all_gather_bytes_and_reduces_in_fp32": 6.7,
    "tests/strategy/test_mesh_strategy.py::test_muon_checkpoint_resumes_under_tensor_parallelism": 6.6,
    "tests/scaling/test_scaling_fit.py::"
    "test_residual_bootstrap_covers_a_known_law_and_is_narrower_than_resampling_points": 6.0,
    "tests/data/test_pretokenized_train.py::test_an_id_past_the_vocabulary_stops_train_before_the_run_folder": 6.0,
    "tests/planning/test_batch.py::test_six_layouts_of_one_config_train_the_same_tokens[ep2]": 5.8,
    "tests/test_prewarmed.py::test_a_rank_from_the_zygote_has_the_popen_s_argv_env_cwd_session_and_exit_code": 5.0,
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
