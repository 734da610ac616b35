"""The planner's figures that README.md and docs/ quote are the planner's: each quote is recomputed here, so a change
to the memory planner that moves a figure fails until the page says what the tool prints (the failure gives the text
to write).

FIGURES: a page and a function of the tools (`lit-pretrain memory`'s own code, in process: scaling/cli.py `_memory`,
what `memory --json` prints) that returns the text the page must hold (ANY where the page has words of its own, as a
table's strategy column). Every decimal size in GB a page states must lie inside one of those texts or be listed in
NOT_PLANNED (a measurement, not a plan), so that a new quote of the planner cannot go unchecked.
"""

import re

import pytest

from lit_pretrain.scaling import cli as scaling_cli
from tests.conftest import ROOT

RUNS = ROOT / "experiments" / "runs"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# docs/configuration.md is generated from the schema (tests/test_docs.py); its sizes are field defaults and examples
SKIP = {"configuration.md"}
# Sizes stated in the pages that are measured, not planned: (page, the text around the figure).
NOT_PLANNED = {("performance.md", "2.15 GB of nanoGPT ids")}
# Pages whose sizes are all measurements: docs/large-runs.md's tables are what `lit-pretrain simulate` measured (with
# the planner's figure beside each, which tests/simulate/test_simulate.py holds to the simulation on the shipped 8B
# files), rerun by the commands the page shows.
MEASURED_PAGES = {"large-runs.md"}
ANY = "…"  # in a quote: a table cell of the page's own words


def _pattern(quote: str) -> str:
    return "[^|]+".join(map(re.escape, quote.split(ANY)))


def _memory(*argv: str) -> dict:
    """What `lit-pretrain memory ARGV --json` prints (its run-file form reads the experiment as `memory --run` does)."""
    args = scaling_cli._parser().parse_args(["memory", *argv])
    return scaling_cli._memory(args)


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"  # as run_plan.format_fit prints it


def _run_row(name: str) -> str:
    """The run file's row of docs/scaling.md's table: its GPUs, (a strategy in words,) micro-batch, checkpointing,
    tokens a step, steps, peak learning rate (as the files write it, 9e-4), per-GPU memory and headroom."""
    run_file = str(RUNS / f"{name}.yaml")
    r = _memory("--run", run_file)
    cfg = scaling_cli._run_config(scaling_cli._parser().parse_args(["memory", "--run", run_file]))
    lr = re.sub(r"e-0*", "e-", f"{cfg.optim.lr_peak:.0e}")
    tail = (f"| {r['micro_batch']}, {r['activation_checkpointing']} | {cfg.trainer.tokens_per_step:,} | "
            f"{cfg.trainer.max_steps:,} | {lr} | {_gb(r['total_bytes'])}, {_gb(r['headroom_bytes'])} "
            f"({r['headroom_fraction']:.0%}) |")
    return f"| `{name}` | {r['world_size']} | {ANY} {tail}"


def _eight_b_at_micro_batch_2() -> str:
    wide = _memory("--run", str(RUNS / "llama3_1_8b_h200x8.yaml"), "trainer.micro_batch_size=2")
    full = _memory("--run", str(RUNS / "llama3_1_8b_h200x8.yaml"), "trainer.micro_batch_size=2",
                   "strategy.activation_checkpointing=full")
    assert not wide["fits"] and full["fits"], "the page says micro-batch 2 needs activation checkpointing"
    return (f"the 8B at micro-batch 2 would need {_gb(wide['total_bytes'])}, and the load says so and names the fix "
            f"(`strategy.activation_checkpointing=full`: {_gb(full['total_bytes'])})")


def _long_context() -> str:
    r = _memory("--run", str(RUNS / "llama3_1_8b_h200x8_128k.yaml"))
    return (f"needs {r['context_parallel_needed']}, with {r['activation_checkpointing']} activation checkpointing "
            f"({_gb(r['total_bytes'])} of {r['device_memory'] / 1e9:g} GB)")


def _olmoe() -> str:
    r = _memory("--layers", "16", "--hidden", "2048", "--heads", "16", "--vocab", "50304", "--seq-len", "4096",
                "--untied", "--model", "qk_norm=true", "--model", "qk_norm_scope=projection", "--model",
                "moe={num_experts: 64, top_k: 8, d_ff_expert: 1024}", "--precision", "bf16-true")
    return (f"says OLMoE-1B-7B needs {r['model_state_bytes'] / 1e9:.1f} GB of model states and "
            f"{r['activation_bytes_per_layer'] / 1e9:.2f} GB of activations per layer for one 4096-token sequence")


def _bench_presets() -> str:
    """`make bench-gpu PRESET=...` plans each preset on one 141 GB H200 (bench/step/gpu.py preset_config)."""
    from lit_pretrain.bench.step.gpu import preset_config

    run_file = str(RUNS / "default.yaml")
    small, small_mb, small_checkpointing, small_note = preset_config(run_file, "llama3_2_1b", 141e9)
    large, _, large_checkpointing, _ = preset_config(run_file, "llama3_1_8b", 141e9)
    planned = re.search(r"([\d.]+) GB planned", small_note).group(1)
    assert small_checkpointing == "none" and large_checkpointing == "full"
    return (f"the 1B whole at micro-batch {small_mb} x {small.seq_len:,} without activation checkpointing ({planned} "
            f"GB planned), the 8B in part, {large.n_layers} of its 32 layers with activation checkpointing")


FIGURES = [
    *[("scaling.md", lambda name=name: _run_row(name)) for name in (
        "llama3_2_1b_h200x8", "llama3_2_1b_h200x32", "llama3_2_3b_h200x8", "llama3_2_3b_h200x32",
        "llama3_1_8b_h200x8", "llama3_1_8b_h200x32")],
    ("scaling.md", _eight_b_at_micro_batch_2),
    ("strategies.md", _long_context),
    ("moe.md", _olmoe),
    ("performance.md", _bench_presets),
]


def _text(name: str) -> str:
    """The page with its lines joined (a quote may wrap), single-spaced."""
    page = ROOT / name if name == "README.md" else ROOT / "docs" / name
    return " ".join(page.read_text().split())


@pytest.fixture(scope="module")
def quotes() -> dict:
    """{page: [the texts the tools give for it]}, computed once for both tests."""
    out = {}
    for page, figure in FIGURES:
        out.setdefault(page, []).append(figure())
    return out


def test_quoted_planner_figures_are_what_the_tools_print(quotes):
    missing = [(page, quote) for page, texts in quotes.items() for quote in texts
               if not re.search(_pattern(quote), _text(page))]
    assert not missing, "pages quote other figures than the tools print; write:\n" + "\n".join(
        f"  {page}: {quote}" for page, quote in missing)


def test_every_size_in_gb_the_pages_state_is_checked(quotes):
    unchecked = []
    for path in PAGES:
        if path.name in SKIP or path.name in MEASURED_PAGES:
            continue
        text = _text(path.name)
        for quote in quotes.get(path.name, []):
            text = re.sub(_pattern(quote), "", text)
        for m in re.finditer(r"\d+\.\d+ GB", text):
            around = text[m.start(): m.start() + 40]
            if not any(page == path.name and around.startswith(known) for page, known in NOT_PLANNED):
                unchecked.append(f"{path.name}: {text[max(0, m.start() - 60): m.end() + 20]}")
    assert not unchecked, ("sizes stated without a check: add the planner's to FIGURES, a measurement to NOT_PLANNED:"
                           "\n" + "\n".join(unchecked))
