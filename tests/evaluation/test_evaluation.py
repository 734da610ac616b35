"""Downstream evaluation through lm-evaluation-harness: our LM against hand computations, `lit-pretrain evaluate`,
and the built-in bits per byte. Nothing downloads: the task is a local JSON Lines file made here."""

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from lit_pretrain import cli, config
from lit_pretrain.data.shards import load_manifest
from lit_pretrain.data.tokenizer import EOD, load_tokenizer, token_byte_lengths, train_tokenizer
from lit_pretrain.model.gpt import GPT
from tests.conftest import EXPERIMENTS, tiny_data_overrides

pytest.importorskip("lm_eval")  # the `eval` extra: installed by `make install` and CI, so this runs there

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ[_var] = "1"

# Multiple choice over the default corpus (Python's standard library): the answer is the continuation a model of
# Python should prefer, at a different position from question to question.
QUESTIONS = [
    ("import", ["the", "os", "))"], 1),
    ("def __init__(self", ["= =", "import", "):"], 2),
    ("for i in", ["range(n):", "else", "None None"], 0),
    ("return", ["((", "None", "def class"], 1),
    ("if x is", ["]]", "import os", "None:"], 2),
    ("class Foo(", ["object):", "return", "for"], 0),
    ("raise", ["in in", "ValueError(", "while"], 1),
    ("    def", ["else:", "import", "__repr__(self):"], 2),
]


# Documents for a perplexity task (lm-eval's loglikelihood_rolling): some longer than the tiny model's 64 tokens, so
# they take several windows; its bits_per_byte is a continuous score, unlike an accuracy over 8 questions.
DOCUMENTS = [
    "def add(a, b):\n    return a + b\n",
    "import os\nimport sys\n\n\ndef main(argv=None):\n    args = sys.argv[1:] if argv is None else argv\n"
    "    for name in args:\n        if os.path.exists(name):\n            print(name, os.path.getsize(name))\n"
    "    return 0\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "    def __repr__(self):\n        return f'Point({self.x!r}, {self.y!r})'\n",
]


def write_task(folder):
    """Two local tasks in `folder`, each a YAML file and JSON Lines data (lm-eval's `dataset_path: json`):
    tiny_mc (multiple choice, acc) and tiny_ppl (rolling log-likelihood: word/byte perplexity, bits per byte)."""
    mc, ppl = folder / "tiny_mc.jsonl", folder / "tiny_ppl.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    ppl.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCUMENTS))
    (folder / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {mc}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: '{{answer}}'\ndoc_to_choice: '{{choices}}'\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (folder / "tiny_ppl.yaml").write_text(
        f"task: tiny_ppl\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {ppl}\n"
        "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    return folder


@pytest.fixture(scope="session")  # built once per worker, whatever the order: tests/helpers/longest_first.py
def eval_run(tmp_path_factory, tiny_data_dir):
    """A run folder as training leaves it (config.yaml, checkpoints/last.ckpt with its sidecar), random weights."""
    from lit_pretrain.resume.verified import META_KEY, save_atomic

    root = tmp_path_factory.mktemp("eval-run")
    cfg = config.load(EXPERIMENTS / "runs" / "tiny.yaml", [*tiny_data_overrides(tiny_data_dir), "model.vocab_size=512",
                                                           f"run.root_dir={root}"])
    run_dir = root / "tiny"
    (run_dir / "checkpoints").mkdir(parents=True)
    config.save(cfg, run_dir / "config.yaml")
    torch.manual_seed(0)
    model = GPT(config.to_object(cfg).model)
    state = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, META_KEY: {"step": 7}}
    save_atomic(state, run_dir / "checkpoints" / "last.ckpt")
    tasks = write_task(tmp_path_factory.mktemp("tasks"))
    tokenizer = load_tokenizer(tiny_data_dir / load_manifest(tiny_data_dir)["tokenizer"]["file"])
    return run_dir, model.eval(), tokenizer, tasks


def summed_logprob(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context) by hand: one forward over the whole text, the continuation's tokens being those
    after the context's own tokens (the split lm-eval's causal models use)."""
    context_ids = tokenizer.encode(context, add_special_tokens=False).ids
    whole = tokenizer.encode(context + continuation, add_special_tokens=False).ids
    with torch.no_grad():
        logprobs = F.log_softmax(model(torch.tensor([whole[:-1]]))[0].float(), dim=-1)  # (T-1, V)
    return sum(logprobs[i - 1, whole[i]].item() for i in range(len(context_ids), len(whole)))


def hand_accuracy(model, tokenizer):
    """(acc, acc_norm) by hand: lm-eval joins question and choice with its default target delimiter, one space;
    acc takes the choice of highest summed log-probability, acc_norm of highest log-probability per character."""
    acc = acc_norm = 0
    for question, choices, answer in QUESTIONS:
        logprobs = [summed_logprob(model, tokenizer, question, " " + c) for c in choices]
        acc += max(range(len(choices)), key=lambda k: logprobs[k]) == answer
        acc_norm += max(range(len(choices)), key=lambda k: logprobs[k] / len(choices[k])) == answer
    return acc / len(QUESTIONS), acc_norm / len(QUESTIONS)


def instances(requests, request_type="loglikelihood"):
    from lm_eval.api.instance import Instance

    return [Instance(request_type, {}, args, i, ("tiny_mc", i, 1)) for i, args in enumerate(requests)]


def test_evaluate_writes_eval_json_with_the_hand_computed_accuracy(eval_run, capsys):
    run_dir, model, tokenizer, tasks = eval_run
    other = run_dir / "notes.txt"
    other.write_text("not ours")
    rc = cli.main(["evaluate", str(run_dir), "--tasks", "tiny_mc", "--include-path", str(tasks), "--batch-size", "3"])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((run_dir / "eval.json").read_text())
    acc, acc_norm = hand_accuracy(model, tokenizer)
    print(f"local task accuracy: lm-eval {report['tasks']['tiny_mc']}, by hand acc {acc}, acc_norm {acc_norm}")
    assert report["tasks"]["tiny_mc"]["acc"] == pytest.approx(acc, abs=1e-12)
    assert report["tasks"]["tiny_mc"]["acc_norm"] == pytest.approx(acc_norm, abs=1e-12)
    assert report["step"] == 7 and report["samples_per_task"] == {"tiny_mc": len(QUESTIONS)}
    assert report["tokens_scored"] > 0 and report["checkpoint"].endswith("last.ckpt")
    assert other.read_text() == "not ours"  # nothing but eval.json is written
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "config.yaml", "eval.json", "notes.txt"]


def test_unknown_task_is_one_line_and_exit_2(eval_run, capsys, monkeypatch):
    from lit_pretrain.evaluation import harness

    run_dir, _, _, tasks = eval_run
    # Only the include path is indexed here (lm-eval's own ~15,000 names take 10-30 s): the path to the error is
    # the same, the list it searches shorter.
    original = harness.task_manager
    monkeypatch.setattr(harness, "task_manager", lambda *a, **k: original(*a, **{**k, "builtin": False}))
    (run_dir / "eval.json").unlink(missing_ok=True)
    rc = cli.main(["evaluate", str(run_dir), "--tasks", "tiny_mcq", "--include-path", str(tasks)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "unknown task 'tiny_mcq'" in err and "closest: tiny_mc" in err
    assert not (run_dir / "eval.json").exists()


def test_loglikelihood_batched_by_length_equals_one_request_at_a_time(eval_run):
    from lit_pretrain.evaluation.lm import LitPretrainLM

    _, model, tokenizer, _ = eval_run
    requests = [(q, " " + c) for q, choices, _ in QUESTIONS[:4] for c in choices]
    context, continuation = "x = 1\n" * 30 + "y =", " 2"  # longer than seq_len 64
    requests.append((context, continuation))
    batched = LitPretrainLM(model, tokenizer, batch_size=5).loglikelihood(instances(requests))
    for (c, k), (logprob, _) in zip(requests[:-1], batched):
        assert logprob == pytest.approx(summed_logprob(model, tokenizer, c, k), abs=1e-4)
    # Truncated from the left, as lm-eval's HF model does: the last seq_len + 1 tokens, the continuation scored.
    n = len(tokenizer.encode(context + continuation).ids) - len(tokenizer.encode(context).ids)
    whole = tokenizer.encode(context + continuation).ids[-65:]
    assert len(tokenizer.encode(context).ids) > 64 and n >= 1
    with torch.no_grad():
        logprobs = F.log_softmax(model(torch.tensor([whole[:-1]]))[0], dim=-1)  # (64, V)
    assert batched[-1][0] == pytest.approx(sum(logprobs[i - 1, whole[i]].item() for i in range(65 - n, 65)), abs=1e-4)


def test_rolling_loglikelihood_and_greedy_generation_against_direct_loops(eval_run):
    from lit_pretrain.evaluation.lm import LitPretrainLM

    _, model, tokenizer, _ = eval_run
    lm = LitPretrainLM(model, tokenizer, batch_size=2)
    text = "def f(x):\n    return x\n"
    ids = [tokenizer.token_to_id(EOD)] + tokenizer.encode(text).ids  # shorter than seq_len: one window after EOD
    with torch.no_grad():
        logprobs = F.log_softmax(model(torch.tensor([ids[:-1]]))[0], dim=-1)
    direct = sum(logprobs[i, ids[i + 1]].item() for i in range(len(ids) - 1))
    assert lm.loglikelihood_rolling(instances([(text,)], "loglikelihood_rolling"))[0] == pytest.approx(direct, abs=1e-4)

    contexts = ["import", "class A:\n    def", "for i in range(10):\n"]
    generated = lm.generate_until(instances([(c, {"until": ["\n\n"], "max_gen_toks": 6}) for c in contexts],
                                            "generate_until"))
    for context, got in zip(contexts, generated):
        seq, new = tokenizer.encode(context).ids, []
        for _ in range(6):  # greedy by hand, one sequence, the whole prefix recomputed each token
            with torch.no_grad():
                token = model(torch.tensor([seq]))[0, -1].argmax().item()
            if token == tokenizer.token_to_id(EOD):
                break
            seq, new = seq + [token], new + [token]
        assert got == tokenizer.decode(new).split("\n\n")[0]


def test_token_byte_lengths_are_the_utf8_bytes_of_the_text():
    texts = ["naïve café ☃ — ünïcode\n" * 3, "def f(x):\n    return x  # ok\n", "日本語のテキスト"]
    tokenizer = train_tokenizer(texts * 5, vocab_size=300)
    table = token_byte_lengths(tokenizer)
    assert table[tokenizer.token_to_id(EOD)] == 0  # the end-of-document token stands for no text
    # Hand count: "é☃" is 2 + 3 bytes in UTF-8, whatever tokens it becomes.
    assert sum(table[i] for i in tokenizer.encode("é☃").ids) == 5
    for text in texts + ["x = 'ß' + \"€\"  # not in training 😀"]:
        assert sum(table[i] for i in tokenizer.encode(text).ids) == len(text.encode("utf-8"))
    from tokenizers import Tokenizer, models, pre_tokenizers

    word_level = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    assert token_byte_lengths(word_level) is None  # not byte-level: no exact per-token byte count


def test_validation_bits_per_byte_against_a_hand_count(tmp_path):
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lit_pretrain.model.config import GPTConfig
    from lit_pretrain.module import PretrainModule
    from lit_pretrain.schema import OptimConfig, ScheduleConfig

    tokenizer = train_tokenizer(["héllo wörld, ☃ snow\n" * 4, "plain ascii text here\n"] * 3, vocab_size=280)
    text = "wörld ☃ héllo snow, plain text\n"  # 26 letters/spaces/punctuation + ö é (2 bytes each) + ☃ (3) + \n
    assert len(text.encode("utf-8")) == 35
    eod = tokenizer.token_to_id(EOD)
    ids = [eod] + tokenizer.encode(text).ids + [eod]  # a document between two end-of-document tokens, as in a shard
    x, y = torch.tensor([ids[:-1]]), torch.tensor([ids[1:]])  # targets: every token of the text, then EOD (0 bytes)

    class Data(L.LightningDataModule):
        token_bytes = token_byte_lengths(tokenizer)

        def val_dataloader(self):
            return DataLoader(TensorDataset(x, y), batch_size=1)

    cfg = GPTConfig(vocab_size=tokenizer.get_vocab_size(), n_layers=1, d_model=32, n_heads=2, seq_len=64)
    module = PretrainModule(cfg, OptimConfig(), ScheduleConfig(), max_steps=1, tokens_per_step=1, seed=0)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=tmp_path)
    logged = trainer.validate(module, datamodule=Data(), verbose=False)[0]
    with torch.no_grad():
        nats = F.cross_entropy(module.model(x)[0], y[0], reduction="sum").item()
    assert logged["val/bits_per_byte"] == pytest.approx(nats / 35 / math.log(2), rel=1e-5)
    assert logged["val/seconds"] > 0


def test_downstream_eval_runs_at_validation_off_the_throughput_clock(tmp_path, tiny_data_dir, monkeypatch):
    import time

    import lightning as L
    from lightning.pytorch.callbacks import Timer
    from lightning.pytorch.loggers import CSVLogger

    from lit_pretrain.callbacks.downstream_eval import DownstreamEval
    from lit_pretrain.callbacks.throughput import ThroughputMonitor
    from lit_pretrain.data.datamodule import TokenShardDataModule
    from lit_pretrain.errors import ConfigError
    from lit_pretrain.module import PretrainModule
    from lit_pretrain.runs.folder import read_metrics

    tasks = write_task(tmp_path)
    with pytest.raises(ConfigError, match=r"every_n_steps=3 is not a multiple of trainer.val_every_n_steps=2"):
        DownstreamEval(["tiny_mc"], val_every_n_steps=2, every_n_steps=3, include_path=[tasks], builtin_tasks=False)
    with pytest.raises(ConfigError, match=r"callbacks.downstream_eval.tasks: unknown task 'tiny_m'"):
        DownstreamEval(["tiny_m"], val_every_n_steps=2, include_path=[tasks], builtin_tasks=False)
    evaluation = DownstreamEval(["tiny_mc"], val_every_n_steps=2, include_path=[tasks], builtin_tasks=False)
    steps = []

    def slow_evaluate(model, trainer):  # stands in for lm-eval: a known cost the throughput must not count
        steps.append(trainer.global_step)
        time.sleep(0.6)
        if trainer.global_step == 4:
            raise ValueError("a task broke")  # a failed evaluation is skipped with a warning; training goes on
        return {"eval/tiny_mc/acc": 0.5}

    monkeypatch.setattr(evaluation, "evaluate", slow_evaluate)
    c = config.to_object(config.load(EXPERIMENTS / "runs" / "tiny.yaml", [*tiny_data_overrides(tiny_data_dir),
                                                                          "model.vocab_size=512"]))
    data = TokenShardDataModule(c.data, seq_len=64, micro_batch_size=2, seed=0, val_windows=2)
    module = PretrainModule(c.model, c.optim, c.schedule, max_steps=4, tokens_per_step=128, seed=0)
    throughput, timer = ThroughputMonitor(log_every_n_steps=1), Timer()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, val_check_interval=2, limit_val_batches=1,
                        num_sanity_val_steps=0, use_distributed_sampler=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=1,
                        logger=CSVLogger(tmp_path / "logs", name="", version=""),
                        callbacks=[timer, throughput, evaluation])
    with pytest.warns(UserWarning, match=r"downstream_eval: the evaluation at step 4 failed and was skipped "
                                         r"\(ValueError: a task broke\)"):
        trainer.fit(module, datamodule=data)
    assert steps == [2, 4] and trainer.global_step == 4  # every validation (every_n_steps null), the last included
    # The throughput clock stops from validation's start to its end, and the evaluation runs inside: at least the
    # 2 × 0.6 s it slept are missing from the seconds it counts, though they are in the Timer's training time.
    assert throughput.totals["seconds"] < timer.time_elapsed("train") - 1.2
    rows = read_metrics(tmp_path / "logs" / "metrics.csv")
    logged = {int(r["step"]): r["eval/seconds"] for r in rows if "eval/seconds" in r}
    assert sorted(logged) == [2] and logged[2] >= 0.6  # the failed evaluation logs nothing
    assert [r["eval/tiny_mc/acc"] for r in rows if "eval/tiny_mc/acc" in r] == [0.5]
    assert all(r["val/bits_per_byte"] > 0 for r in rows if "val/loss" in r)


def budgeted(tokenizer):
    """The token budget by hand: the model's input tokens per document (a question's 3 requests are question + " " +
    choice less its last token; a perplexity document is its own tokens, the first after the prefix token), and a
    budget whose equal share per task takes the first 3 questions and the perplexity documents that fit in it."""
    mc = [sum(len(tokenizer.encode(f"{q} {c}").ids) - 1 for c in choices) for q, choices, _ in QUESTIONS]
    ppl = [len(tokenizer.encode(t).ids) for t in DOCUMENTS]
    share = sum(mc[:3])
    n_ppl = max(1, max(k for k in range(len(ppl) + 1) if sum(ppl[:k]) <= share))
    return 2 * share + 1, 3, n_ppl, sum(mc[:3]) + sum(ppl[:n_ppl])


def check_run(run_dir, tasks, n_mc, n_ppl, tokens, eval_steps):
    """The scores logged during training are those `lit-pretrain evaluate` gives offline on the last checkpoint."""
    from lit_pretrain.evaluation.command import evaluate
    from lit_pretrain.runs.folder import read_metrics

    rows = read_metrics(run_dir / "metrics.csv")
    scored = {int(r["step"]): r for r in rows if "eval/tiny_mc/acc" in r}
    assert sorted(scored) == eval_steps
    last = scored[eval_steps[-1]]
    assert last["eval/tokens"] == tokens and last["eval/seconds"] > 0
    mc = evaluate(run_dir, ["tiny_mc"], limit=n_mc, include_path=[str(tasks)])["tasks"]["tiny_mc"]
    ppl = evaluate(run_dir, ["tiny_ppl"], limit=n_ppl, include_path=[str(tasks)])["tasks"]["tiny_ppl"]
    assert last["eval/tiny_mc/acc"] == pytest.approx(mc["acc"], abs=1e-12)
    # Continuous: other weights would not give it. fp32 both times; batches differ, so sums in another order.
    assert last["eval/tiny_ppl/bits_per_byte"] == pytest.approx(ppl["bits_per_byte"], rel=1e-5)
    return rows


@pytest.mark.slow
def test_training_with_downstream_eval_logs_the_offline_score_and_bits_per_byte(tmp_path, tiny_data_dir, eval_run):
    from lit_pretrain.evaluation.harness import samples_within_budget
    from lit_pretrain.train import train

    _, _, tokenizer, tasks = eval_run
    budget, n_mc, n_ppl, tokens = budgeted(tokenizer)
    per_doc = [sum(len(tokenizer.encode(f"{q} {c}").ids) - 1 for c in choices) for q, choices, _ in QUESTIONS]
    assert samples_within_budget({"tiny_mc": dict(enumerate(per_doc))}, sum(per_doc[:3])) == {"tiny_mc": [0, 1, 2]}
    cfg = config.load(EXPERIMENTS / "runs" / "tiny.yaml", [
        *tiny_data_overrides(tiny_data_dir), f"run.root_dir={tmp_path}", "trainer.progress_bar=false",
        "trainer.max_steps=6", "trainer.val_every_n_steps=2", "trainer.checkpoint_every_n_steps=0",
        "schedule.warmup_steps=2", "callbacks.downstream_eval.enabled=true",
        "callbacks.downstream_eval.tasks=[tiny_mc,tiny_ppl]", f"callbacks.downstream_eval.include_path=[{tasks}]",
        "callbacks.downstream_eval.every_n_steps=4", f"callbacks.downstream_eval.max_tokens={budget}"])
    summary = train(cfg)
    run_dir = tmp_path / "tiny"
    rows = check_run(run_dir, tasks, n_mc, n_ppl, tokens, eval_steps=[4, 6])  # every 4 steps, and the last step
    on_disk = json.loads((run_dir / "summary.json").read_text())
    val = [r for r in rows if "val/bits_per_byte" in r]
    assert len(val) == 3 and on_disk["val_bits_per_byte"] == pytest.approx(val[-1]["val/bits_per_byte"])
    assert summary["val_bits_per_byte"] == on_disk["val_bits_per_byte"] > 0
    spent = sum(r.get("eval/seconds", 0) + r.get("val/seconds", 0) for r in rows)
    assert on_disk["evaluation_seconds"] == pytest.approx(spent) and 0 < spent < on_disk["wall_seconds"]


@pytest.mark.slow
def test_downstream_eval_under_zero_stage_3_gathers_the_weights_to_rank_0(tmp_path, tiny_data_dir, eval_run):
    from tests.conftest import run_module, train_args

    _, _, tokenizer, tasks = eval_run
    budget, n_mc, n_ppl, tokens = budgeted(tokenizer)
    # 2 processes, each holding half of every parameter: rank 0 evaluates a gathered copy, rank 1 waits.
    run_module(*train_args(tiny_data_dir, tmp_path, "z3"), "strategy=zero", "strategy.zero_stage=3",
               "trainer.devices=2", "trainer.micro_batch_size=4", "trainer.max_steps=4", "trainer.val_every_n_steps=2",
               "schedule.warmup_steps=1",
               "trainer.progress_bar=false", "strategy.timeout_seconds=120", "callbacks.downstream_eval.enabled=true",
               "callbacks.downstream_eval.tasks=[tiny_mc,tiny_ppl]",
               f"callbacks.downstream_eval.include_path=[{tasks}]",
               f"callbacks.downstream_eval.max_tokens={budget}", timeout=300)  # offline: os.environ, set above
    check_run(tmp_path / "z3", tasks, n_mc, n_ppl, tokens, eval_steps=[2, 4])


def test_without_lm_eval_evaluate_and_the_callback_say_how_to_install_it(eval_run, capsys, monkeypatch):
    import importlib.util

    from lit_pretrain.callbacks.downstream_eval import DownstreamEval
    from lit_pretrain.errors import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    assert cli.main(["evaluate", str(eval_run[0]), "--tasks", "tiny_mc"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'lit-pretrain[eval]'" in err
    with pytest.raises(ConfigError, match=r"callbacks.downstream_eval.enabled=true needs lm-evaluation-harness"):
        DownstreamEval(["tiny_mc"], val_every_n_steps=2)


@pytest.mark.parametrize("max_steps, every, runs", [(200, 50, 4), (210, 50, 5), (49, 50, 1), (6, 2, 3)])
def test_evaluation_count_and_wall_share(max_steps, every, runs):
    from lit_pretrain.bench.evaluation.in_training import evaluations, wall_share

    assert evaluations(max_steps, every) == runs  # every `every` steps, and the last step when not a multiple
    # 200 steps of 1 s and 4 evaluations of 5 s: 20 s of 220.
    assert wall_share(200, 1.0, 4, 5.0) == pytest.approx(20 / 220)
