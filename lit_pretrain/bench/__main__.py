"""`python -m lit_pretrain.bench [RUN_FILE] [key=value ...] [--cases step,compile]`: run every case (or the chosen
groups), print one table, write results.json and append one line per case to runs/bench/history.jsonl.

The model, batch and seed come from the experiment (default: experiments/runs/default.yaml), so the benchmark
measures the step that `make train` runs.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional

from lit_pretrain.bench import history, stats

# The case modules (and torch, Lightning) are imported inside the functions below, so an unknown --cases name is
# reported in a fraction of a second and a subset imports only what it runs.


class _Run:
    """What the case groups share: the config, the arguments, and what is measured or prepared once on demand."""

    def __init__(self, c, args, tmp: Path, peak: Optional[float]):
        self.c, self.args, self.tmp, self.peak = c, args, tmp, peak
        self.step_cases: Optional[List[Dict]] = None
        self._sample = None

    @property
    def sample(self):
        # The prepared sample shared by the datamodule, tokenize and evaluation cases; made only if one is chosen.
        if self._sample is None:
            from lit_pretrain.bench.data import datamodule

            self._sample = datamodule.prepare_sample(self.c.data, self.tmp / "prepared")
        return self._sample

    def step_tokens_per_s(self) -> float:
        return self.step_cases[0]["value"]


def _step(r: _Run) -> List[Dict]:
    from lit_pretrain.bench.step import checkpointing, step

    r.step_cases = [step.run(r.c, r.args.steps, r.args.skip, r.args.repeats)]
    return r.step_cases + checkpointing.run(r.c)


def _compile(r: _Run) -> List[Dict]:
    from lit_pretrain.bench.step import compile

    return compile.run(r.c, r.args.steps, r.args.skip, r.args.repeats, r.peak)


def _precision(r: _Run) -> List[Dict]:
    from lit_pretrain.bench.step import precision

    return precision.run(r.c, r.args.steps, r.args.skip, r.args.repeats)


def _datamodule(r: _Run) -> List[Dict]:
    from lit_pretrain.bench.data import datamodule, pretokenized

    consumed = r.step_tokens_per_s()
    return [datamodule.run(r.c, r.sample, consumed_tokens_per_s=consumed, repeats=r.args.repeats),
            *pretokenized.run(r.c, r.sample, consumed, r.args.repeats, r.tmp)]  # the same over a Megatron corpus


def _tokenize(r: _Run) -> List[Dict]:
    from lit_pretrain.bench.data import tokenize

    return tokenize.run(r.sample, r.args.repeats)


def _prepare_memory(r: _Run) -> List[Dict]:
    from lit_pretrain.bench.data import prepare_memory

    return [prepare_memory.run(r.tmp)]


def _shuffle_memory(r: _Run) -> List[Dict]:
    from lit_pretrain.bench.data import shuffle_memory

    return [shuffle_memory.run(r.tmp)]


def _evaluation(r: _Run) -> List[Dict]:
    from lit_pretrain.bench.evaluation import in_training

    return [in_training.run(r.c, r.sample, r.step_tokens_per_s(), r.args.repeats)]


def _deduplication(r: _Run) -> List[Dict]:
    from lit_pretrain.bench.data import deduplication

    return deduplication.run(r.c.data.deduplication, r.args.repeats)


def _data_engines(r: _Run) -> List[Dict]:
    from lit_pretrain.bench.data import data_engines

    return data_engines.run(r.args.repeats)


def _strategies(r: _Run) -> List[Dict]:
    from lit_pretrain.bench.parallel import strategies

    return strategies.run(r.c, r.args.run_file, r.args.overrides)


def _pipeline(r: _Run) -> List[Dict]:
    from lit_pretrain.bench.parallel import pipeline

    return pipeline.run(r.c)


def _compositions(r: _Run) -> List[Dict]:
    from lit_pretrain.bench.parallel import compositions, mixed_precision

    return compositions.run(r.c) + mixed_precision.run(r.c)


def _stability(r: _Run) -> List[Dict]:
    from lit_pretrain.bench.step import stability

    return [stability.run(r.c, r.args.steps, r.args.skip, r.args.repeats)]


def _checkpoint(r: _Run) -> List[Dict]:
    from lit_pretrain.bench.checkpoint import atomic_write, sharded_checkpoint

    return [atomic_write.run(r.c, r.args.repeats), *sharded_checkpoint.run(r.c, r.args.repeats)]


def _generation(r: _Run) -> List[Dict]:
    from lit_pretrain.bench.evaluation import generation

    return [generation.run(r.c, r.args.repeats)]


def _mixture(r: _Run) -> List[Dict]:
    from lit_pretrain.bench.data import mixture

    return [mixture.run(r.c, r.step_tokens_per_s(), r.args.repeats)]


def _masking(r: _Run) -> List[Dict]:
    from lit_pretrain.bench.step import masking, window

    return [masking.run(r.c, r.args.repeats), window.run(r.c, r.args.repeats)]


def _variants(r: _Run) -> List[Dict]:
    from lit_pretrain.bench.step import variants

    return variants.run(r.c, r.args.repeats)


def _moe(r: _Run) -> List[Dict]:
    from lit_pretrain.bench.moe import expert_parallel, mlp

    return [*mlp.run(r.c, r.args.repeats), *expert_parallel.run(r.c, r.args.repeats)]


def _long_context(r: _Run) -> List[Dict]:
    from lit_pretrain.bench.parallel import long_context

    return long_context.run(r.c)


def _loss(r: _Run) -> List[Dict]:
    from lit_pretrain.bench.step import chunked_loss

    return chunked_loss.run(r.c, r.args.repeats)


CASES: Dict[str, Callable[[_Run], List[Dict]]] = {
    "step": _step, "compile": _compile, "precision": _precision, "datamodule": _datamodule, "tokenize": _tokenize,
    "evaluation": _evaluation, "deduplication": _deduplication, "strategies": _strategies, "pipeline": _pipeline,
    "compositions": _compositions, "stability": _stability, "checkpoint": _checkpoint, "generation": _generation,
    "prepare_memory": _prepare_memory, "mixture": _mixture, "masking": _masking, "data_engines": _data_engines,
    "moe": _moe, "long_context": _long_context, "shuffle_memory": _shuffle_memory, "loss": _loss,
    "variants": _variants,
}
assert tuple(CASES) == history.CASE_GROUPS


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lit_pretrain.bench", description=__doc__)
    parser.add_argument("run_file", nargs="?", default="experiments/runs/default.yaml")
    parser.add_argument("overrides", nargs="*")
    # 14 steps (10 timed, ~3 s of the default model) a run, 5 alternations a case: `make bench` stays under 12
    # minutes on 2 cores. The first 4 steps hold the compiled side's compile (and its recompile for backward).
    parser.add_argument("--steps", type=int, default=14, help="optimizer steps per timed run")
    parser.add_argument("--skip", type=int, default=4, help="first steps left out of the timing")
    parser.add_argument("--repeats", type=int, default=stats.ALTERNATIONS,
                        help="alternations of reference and candidate (each case reports their median and spread)")
    parser.add_argument("--cases", default="", help=f"comma-separated case groups (default all): {', '.join(CASES)}")
    parser.add_argument("--out", default="runs/bench/results.json")
    parser.add_argument("--history", default="runs/bench/history.jsonl",
                        help="one JSON line per case is appended here (empty: no history)")
    args = parser.parse_args(argv)
    try:  # before anything is loaded or measured
        chosen = history.parse_cases(args.cases)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None

    import lightning
    import torch

    from lit_pretrain import config as config_lib
    from lit_pretrain.bench.step import mfu
    from lit_pretrain.train import resolve_vocab, setup_process

    c = config_lib.load(args.run_file, args.overrides)
    setup_process(c.trainer)
    c = resolve_vocab(c, c.data.vocab_size)  # the step's cost depends on the vocabulary size, not its contents
    if {"datamodule", "evaluation", "mixture"} & set(chosen) and "step" not in chosen:
        # They compare against the tokens/s the Trainer's step consumes, so they run the step case first (it is
        # reported and recorded like a chosen one).
        chosen = ["step", *chosen]
    # The matmul peak (compile's MFU reference) only when compile is chosen, before any case, on the training threads.
    peak = mfu.cpu_matmul_peak() if "compile" in chosen else None
    with tempfile.TemporaryDirectory() as tmp:
        r = _Run(c, args, Path(tmp), peak)
        results = {name: CASES[name](r) for name in chosen}  # chosen is in CASES' order: step comes first
    cases = [case for group in results.values() for case in group]

    print(f"\n{'case':<32} {'value':>14} {'reference':>14} {'ratio':>7} {'spread':>7}  goal")
    for case in cases:
        spread = f"{case['spread']:>7.3f}" if "spread" in case else f"{'-':>7}"
        print(f"{case['case']:<32} {case['value']:>14,.1f} {case['reference']:>14,.1f} {case['ratio']:>7.3f} "
              f"{spread}  {case['goal']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fields = history.machine_fields(torch.get_num_threads(), torch.__version__)
    machine = {**fields, "lightning": lightning.__version__, "matmul_peak_flops_per_s": peak,
               "fingerprint": history.fingerprint(fields)}
    out.write_text(json.dumps({"machine": machine, "experiment": args.run_file, "cases_run": list(results),
                               "cases": cases}, indent=2) + "\n")
    print(f"wrote {out}")
    if args.history:
        print()
        history.record_and_compare(Path(args.history), cases, history.git_commit(), history.fingerprint(fields))


if __name__ == "__main__":
    main()
