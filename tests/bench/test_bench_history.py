"""`make bench`'s history (bench/history.py), its case selection, and `make bench-gpu --dry-run`; no benchmark runs."""

import json

import pytest

from lit_pretrain.bench import history
from tests.conftest import ROOT, run_module


@pytest.mark.parametrize("text, expected", [
    ("", list(history.CASE_GROUPS)),
    (None, list(history.CASE_GROUPS)),
    ("compile,step", ["step", "compile"]),  # the full run's order, whatever order they were named in
    ("generation", ["generation"]),
    (" step , tokenize ", ["step", "tokenize"]),
])
def test_parse_cases(text, expected):
    assert history.parse_cases(text) == expected


@pytest.mark.parametrize("text", ["nope", "step,nope", ",", "Step"])
def test_parse_cases_rejects_unknown_names_naming_the_valid_ones(text):
    with pytest.raises(ValueError, match="expected a comma-separated list of step, compile, precision"):
        history.parse_cases(text)


def test_every_case_group_has_a_function():
    from lit_pretrain.bench.__main__ import CASES

    assert tuple(CASES) == history.CASE_GROUPS


def test_unknown_case_exits_2_with_one_line_before_measuring(tmp_path):
    out = run_module("lit_pretrain.bench", "--cases", "nope", "--out", str(tmp_path / "r.json"),
                     "--history", str(tmp_path / "h.jsonl"), rc=2, timeout=60)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "nope" in lines[0] and "generation" in lines[0], out.stderr
    assert out.stdout == "" and list(tmp_path.iterdir()) == []  # nothing measured, nothing written


def test_fingerprint_is_short_stable_and_changes_with_the_machine():
    fields = history.machine_fields(2, "2.13.0")
    assert history.fingerprint(fields) == history.fingerprint(dict(reversed(list(fields.items()))))
    assert len(history.fingerprint(fields)) == 12
    assert history.fingerprint(fields) != history.fingerprint(history.machine_fields(4, "2.13.0"))
    assert history.fingerprint(fields) != history.fingerprint(history.machine_fields(2, "2.14.0"))


@pytest.mark.parametrize("ratio, prev, expected", [
    (0.97, {"ratio": 1.02}, "ratio 0.970 (previous 1.020, -4.9%)"),
    (1.10, {"ratio": 1.0}, "ratio 1.100 (previous 1.000, +10.0%)"),
    (1.0, {"ratio": 0}, "ratio 1.000 (previous 0.000, n/a)"),
    (0.5, None, "ratio 0.500 (no previous run on this machine)"),
])
def test_change_line(ratio, prev, expected):
    line = history.change_line("trainer_step_tokens_per_s", ratio, prev)
    assert line.startswith("trainer_step_tokens_per_s ") and line.endswith(expected)


@pytest.mark.parametrize("ratio, spread, prev, expected", [
    # |1.10 - 1.00| = 0.10 > max(0.04, 0.05): a move neither run's noise explains.
    (1.10, 0.04, {"ratio": 1.0, "spread": 0.05}, "ratio 1.100 spread 0.040 (previous 1.000, +10.0%: moved more "
                                                  "than its spread)"),
    # 0.03 <= the previous run's spread 0.05: the larger spread is the yardstick.
    (1.03, 0.01, {"ratio": 1.0, "spread": 0.05}, "ratio 1.030 spread 0.010 (previous 1.000, +3.0%: within the "
                                                  "spread)"),
    # A line from before spreads were kept: this run's spread alone decides.
    (0.90, 0.05, {"ratio": 1.0}, "ratio 0.900 spread 0.050 (previous 1.000, -10.0%: moved more than its spread)"),
    (0.90, None, {"ratio": 1.0}, "ratio 0.900 (previous 1.000, -10.0%)"),  # neither has one: no verdict
    (0.90, 0.05, None, "ratio 0.900 spread 0.050 (no previous run on this machine)"),
])
def test_change_line_says_whether_the_median_moved_more_than_its_spread(ratio, spread, prev, expected):
    assert history.change_line("compiled_step_tokens_per_s", ratio, prev, spread).endswith(expected)


def _row(case, ratio, machine="m1"):
    return {"date": "2026-12-03T00:00:00+00:00", "commit": None, "machine": machine, "case": case,
            "value": ratio, "reference": 1.0, "ratio": ratio}


def test_read_skips_malformed_lines_with_a_warning_naming_file_and_line(tmp_path):
    path = tmp_path / "history.jsonl"
    lines = [json.dumps(_row("a", 1.0)), "{not json", "", json.dumps([1, 2]), json.dumps({"case": "b"}),
             json.dumps(_row("a", 0.9))]
    path.write_text("\n".join(lines) + "\n")
    rows, warnings = history.read(path)
    assert [r["ratio"] for r in rows] == [1.0, 0.9]
    assert warnings == [f"warning: {path}:{n}: not a bench history line, skipped" for n in (2, 4, 5)]
    assert history.read(tmp_path / "missing.jsonl") == ([], [])


def test_previous_is_the_last_line_of_the_same_case_on_the_same_machine():
    rows = [_row("a", 1.0), _row("b", 2.0), _row("a", 1.1), _row("a", 5.0, machine="m2")]
    assert history.previous(rows, "a", "m1")["ratio"] == 1.1
    assert history.previous(rows, "a", "m2")["ratio"] == 5.0
    assert history.previous(rows, "b", "m2") is None


def test_record_and_compare_appends_and_never_rewrites(tmp_path, capsys):
    path = tmp_path / "bench" / "history.jsonl"
    cases = [{"case": "a", "value": 10.0, "reference": 10.0, "ratio": 1.02, "spread": 0.01, "alternations": 5},
             {"case": "b", "value": 3.0, "reference": 1.0, "ratio": 3.0}]
    history.record_and_compare(path, cases, "abc123", "m1")
    first = path.read_text()
    with path.open("a") as f:
        f.write("garbage\n")
    cases[0] = {**cases[0], "ratio": 0.97}
    history.record_and_compare(path, cases, None, "m1")
    text = path.read_text()
    assert text.startswith(first + "garbage\n")  # earlier lines (the malformed one too) left as they were
    new = [json.loads(line) for line in text.splitlines()[-2:]]
    assert [(r["case"], r["ratio"], r["commit"], r["machine"]) for r in new] == [("a", 0.97, None, "m1"),
                                                                                 ("b", 3.0, None, "m1")]
    assert set(new[0]) == {"date", "commit", "machine", "case", "value", "reference", "ratio", "spread",
                           "alternations"}
    assert set(new[1]) == {"date", "commit", "machine", "case", "value", "reference", "ratio"}  # none measured
    out, err = capsys.readouterr()
    assert "ratio 0.970 spread 0.010 (previous 1.020, -4.9%: moved more than its spread)" in out
    assert "ratio 3.000 (previous 3.000, +0.0%)" in out
    assert err.strip() == f"warning: {path}:3: not a bench history line, skipped"


@pytest.mark.slow
def test_gpu_bench_dry_run_runs_the_code_path_on_cpu(tmp_path):
    """`make bench-gpu --dry-run` (tiny model, CPU, FSDP2 over gloo, 3 steps) so the script cannot rot unseen."""
    out = run_module("lit_pretrain.bench.step.gpu", "--dry-run", "--models", "125m", "--cases=",
                     "--out", str(tmp_path / "r.json"), timeout=120)  # the cases after the pair: the preset's test
    assert "gpu_125m_compiled_step_tokens_per_s" in out.stdout and "mfu_gpu_125m_compiled" in out.stdout
    assert "dry run" in out.stdout and not (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_gpu_bench_dry_run_of_a_preset_fits_it_to_the_device(tmp_path):
    """`make bench-gpu PRESET=llama3_1_8b DRY_RUN=1`: the preset shrunk to 4 tiny layers and a 3 MB "device", so the
    layer-dropping path of the fit runs too (the full-size choices are test_preset_fit_on_one_h200's); then every
    case of bench/step/gpu_cases.py, printed beside torchtitan's row."""
    from lit_pretrain.parallel.activation_checkpointing import MODES

    out = run_module("lit_pretrain.bench.step.gpu", "--dry-run", "--preset", "llama3_1_8b", "--device-memory", "3MB",
                     "--out", str(tmp_path / "r.json"), timeout=240)
    assert "llama3_1_8b: 4 layers do not fit one 0.003 GB device" in out.stdout
    assert "running 1 of the 4 layers" in out.stdout
    assert "gpu_llama3_1_8b_compiled_step_tokens_per_s" in out.stdout and "mfu_gpu_llama3_1_8b_compiled" in out.stdout
    assert "dry run" in out.stdout and not (tmp_path / "r.json").exists()
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines() if " (FSDP" in line}
    # The shrunk preset's 1 layer: d 64, MLP 128, one key/value head of 16: all 7 linears convert (dims of 16s).
    for name, fp8 in (("bf16_eager", "-"), ("bf16", "-"), ("bf16_policy", "0"), ("fp8_rowwise", "7"),
                      ("fp8_tensorwise", "7")):
        assert rows[name][4] == fp8, (name, rows)
    assert rows["fp8_rowwise"][5] == "8,532" and rows["bf16_policy"][5] == "6,667" and rows["bf16_eager"][5] == "5,762"
    assert rows["bf16_policy"][3] in ("float32", "bfloat16")  # the dtype FSDP2 gathered the weights in
    for name in ("fp8_rowwise", "fp8_tensorwise", "bf16_policy"):
        assert f"gpu_llama3_1_8b_{name}_tokens_per_s" in out.stdout
    # strategy.activation_checkpointing=selective runs where this checkout has it.
    assert ("selective" in rows) == ("selective" in MODES)
    assert ("selective: not run" in out.stdout) == ("selective" not in MODES)


def test_preset_fit_on_one_h200():
    """What `make bench-gpu PRESET=...` runs on one 141 GB H200, decided by the memory planner (bf16-mixed, FSDP on one
    rank, 10% headroom): the 1B whole without activation checkpointing, the 8B only in part (its model states alone,
    16 bytes x 8.03B = 128 GB, pass 90% of 141 GB)."""
    from lit_pretrain import config
    from lit_pretrain.bench.step.gpu import fit_one_device

    def preset(name):
        return config.to_object(config.load(ROOT / "experiments" / "runs" / "default.yaml",
                                            [f"model={name}", "trainer.tokens_per_step=null"])).model

    model, micro_batch, checkpointing, note = fit_one_device(preset("llama3_2_1b"), 141e9)
    assert (model.n_layers, micro_batch, checkpointing) == (16, 2, "none")
    model, micro_batch, checkpointing, note = fit_one_device(preset("llama3_1_8b"), 141e9)
    assert (model.n_layers, micro_batch, checkpointing) == (21, 1, "full")
    assert "their model states alone are 128 GB" in note and "running 21 of the 32 layers" in note


def test_gpu_bench_without_cuda_and_without_dry_run_still_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = run_module("lit_pretrain.bench.step.gpu", rc=1, timeout=60)
    assert "needs a CUDA GPU" in out.stderr and "make bench" in out.stderr
