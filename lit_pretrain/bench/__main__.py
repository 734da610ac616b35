"""`python -m lit_pretrain.bench [RUN_FILE] [key=value ...]`: run every case, print one table, write results.json.

The model, batch and seed come from the experiment (default: experiments/runs/default.yaml), so the benchmark
measures the step that `make train` runs.
"""

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path

import lightning
import torch

from lit_pretrain import config as config_lib
from lit_pretrain.bench import (
    checkpoint,
    compile,
    datamodule,
    deduplication,
    evaluation,
    generation,
    mfu,
    pipeline,
    precision,
    stability,
    step,
    strategies,
    tokenize,
)
from lit_pretrain.train import resolve_vocab, setup_process


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lit_pretrain.bench", description=__doc__)
    parser.add_argument("run_file", nargs="?", default="experiments/runs/default.yaml")
    parser.add_argument("overrides", nargs="*")
    # 25 steps (20 timed) keep `make bench` under 10 minutes on 2 cores; 40 gave the same ratios within noise.
    parser.add_argument("--steps", type=int, default=25, help="optimizer steps per timed run")
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the timing")
    parser.add_argument("--repeats", type=int, default=2, help="alternations of reference and candidate")
    parser.add_argument("--out", default="runs/bench/results.json")
    args = parser.parse_args(argv)

    c = config_lib.to_object(config_lib.load(args.run_file, args.overrides))
    setup_process(c.trainer)
    c = resolve_vocab(c, c.data.vocab_size)  # the step's cost depends on the vocabulary size, not its contents
    peak = mfu.cpu_matmul_peak()  # before any case, on the threads training uses
    cases = [step.run(c, args.steps, args.skip, args.repeats)]
    cases += compile.run(c, args.steps, args.skip, args.repeats, peak)
    cases.append(precision.run(c))
    with tempfile.TemporaryDirectory() as tmp:
        sample = datamodule.prepare_sample(c.data, Path(tmp) / "prepared")
        cases.append(datamodule.run(c, sample, consumed_tokens_per_s=cases[0]["value"]))
        cases.append(tokenize.run(sample, args.repeats))
        cases.append(evaluation.run(c, sample, cases[0]["value"], args.repeats))
    cases += deduplication.run(c.data.deduplication, args.repeats)
    cases += strategies.run(c, args.run_file, args.overrides)
    cases += pipeline.run(c)
    cases.append(stability.run(c, args.steps, args.skip, args.repeats))
    cases.append(checkpoint.run(c, args.repeats))
    cases.append(generation.run(c, args.repeats))

    print(f"\n{'case':<32} {'value':>14} {'reference':>14} {'ratio':>7}  goal")
    for case in cases:
        print(f"{case['case']:<32} {case['value']:>14,.1f} {case['reference']:>14,.1f} {case['ratio']:>7.3f}  "
              f"{case['goal']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
               "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
               "torch": torch.__version__, "lightning": lightning.__version__, "matmul_peak_flops_per_s": peak}
    out.write_text(json.dumps({"machine": machine, "experiment": args.run_file, "cases": cases}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
