"""KV-cache decoding and sampling (evaluation/generate.py, GPT.forward_cached) and `lit-pretrain generate`."""

import pytest
import torch

from lit_pretrain import cli
from lit_pretrain.errors import ConfigError
from lit_pretrain.evaluation.generate import generate, next_token
from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT
from tests.conftest import EXPERIMENTS, tiny_data_overrides

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
# The two paths compute the same sums in different orders (one query row against the cache, or every row of the
# prefix; sdpa over different lengths), so logits differ by fp32 rounding: measured max 1.4e-5 on logits up to 13
# (~1e-6 relative, tens of ulps after 2 layers). 1e-4 leaves a 7x margin and is still far below the smallest gap
# between the two best tokens in these runs (0.015), so greedy tokens must match exactly.
LOGITS_ATOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Steps of this tiny model take ~3 ms on one thread; two threads on a busy machine spent 40x that waiting in
    OpenMP barriers (measured here under load 7 on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model() -> GPT:
    # init_std 0.5, not the training init 0.02: a random model at 0.02 is near uniform and greedy decoding repeats
    # one token; at 0.5 its logits reach ~13 and greedy picks vary, so the comparison below tests something.
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=97, n_layers=2, d_model=32, n_heads=4, seq_len=48, init_std=0.5)).eval()


@pytest.mark.parametrize("num_samples", [1, 3])
def test_greedy_with_the_cache_equals_recomputing_the_prefix(model, num_samples):
    cached_logits, full_logits = [], []
    cached = generate(model, PROMPT, 30, num_samples=num_samples, temperature=0, step_logits=cached_logits)
    full = generate(model, PROMPT, 30, num_samples=num_samples, temperature=0, use_cache=False,
                    step_logits=full_logits)
    assert cached.tokens == full.tokens and cached.steps == full.steps == 30
    assert len(set(full.tokens[0])) > 5  # varied tokens: a repeated one would hide a wrong position
    for step, (a, b) in enumerate(zip(cached_logits, full_logits)):
        torch.testing.assert_close(a, b, rtol=0, atol=LOGITS_ATOL, msg=f"step {step}")


def test_cache_fed_in_chunks_gives_the_full_forward(model):
    """Several new tokens after a filled cache: the causal triangle offset by the cached positions."""
    idx = torch.tensor([PROMPT + PROMPT[::-1] + PROMPT], dtype=torch.long)  # (1, 24)
    cache = model.new_cache(1)
    with torch.no_grad():
        model.forward_cached(idx[:, :5], cache)
        got = model.forward_cached(idx[:, 5:17], cache)  # 12 queries over 17 keys
        want = model(idx[:, :17])[:, -1]
    assert cache.length == 17
    torch.testing.assert_close(got, want, rtol=0, atol=LOGITS_ATOL)


def sample(model, seed, **kw):
    return generate(model, PROMPT, 25, num_samples=2, generator=torch.Generator().manual_seed(seed), **kw).tokens


def test_same_seed_same_sample_other_seed_other_sample(model):
    assert sample(model, 0) == sample(model, 0)
    # 2 × 25 tokens at temperature 1 over 97 tokens: equal samples from two seeds would be a broken generator.
    assert sample(model, 0) != sample(model, 1)
    assert sample(model, 0)[0] != sample(model, 0)[1]  # the rows of one batch are separate samples


def test_top_k_one_and_a_tiny_nucleus_are_greedy(model):
    greedy = generate(model, PROMPT, 25, num_samples=2, temperature=0).tokens
    assert sample(model, 7, top_k=1) == greedy
    assert sample(model, 7, top_p=1e-6) == greedy
    assert sample(model, 7, top_k=5) != greedy  # the filters are what made it greedy


def test_top_k_and_top_p_keep_the_tokens_they_name():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = lambda **kw: set(next_token(logits.expand(400, -1), generator=torch.Generator().manual_seed(0),  # noqa: E731
                                        **kw).tolist())
    assert draws() == {0, 1, 2, 3}
    assert draws(top_k=2) == {0, 1}
    # Nucleus: keep the most probable tokens until their mass reaches p (0.5 + 0.3 = 0.8 >= 0.7; 0.5 >= 0.5).
    assert draws(top_p=0.7) == {0, 1}
    assert draws(top_p=0.5) == {0}
    assert draws(top_p=0.81) == {0, 1, 2}


def test_each_row_stops_at_the_end_of_document_token(model):
    free = sample(model, 3)
    eod = free[0][4]  # a token the first row samples at step 4
    stopped = generate(model, PROMPT, 25, num_samples=2, generator=torch.Generator().manual_seed(3), eod_id=eod)
    for row_free, row in zip(free, stopped.tokens):
        # Same stream: each row is the free row cut before its first EOD (the whole row when it never samples it).
        cut = row_free.index(eod) if eod in row_free else len(row_free)
        assert row == row_free[:cut]
    assert stopped.tokens[0] == free[0][:4]
    # The batch stops once every row has: here no later than the last row's first EOD.
    assert stopped.steps == max(r.index(eod) + 1 if eod in r else 25 for r in free)


def test_new_tokens_stop_at_the_context_and_a_too_long_prompt_is_refused(model):
    assert generate(model, list(range(40)), 100, temperature=0).steps == 48 - 40
    with pytest.raises(ConfigError, match=r"--prompt is 48 tokens but the context \(model.seq_len\) is 48"):
        generate(model, list(range(48)), 10)


@pytest.mark.slow
def test_cli_generates_from_a_tiny_run(tmp_path, tiny_data_dir, capsys):
    from lit_pretrain import config
    from lit_pretrain.train import train

    train(config.load(EXPERIMENTS / "runs" / "tiny.yaml", [
        *tiny_data_overrides(tiny_data_dir), f"run.root_dir={tmp_path}", "trainer.progress_bar=false",
        "trainer.max_steps=2", "trainer.val_windows=8", "schedule.warmup_steps=1", "trainer.num_threads=1"]))
    run_dir = tmp_path / "tiny"
    capsys.readouterr()
    assert cli.main(["generate", str(run_dir), "--prompt", "def ", "--max-new-tokens", "12", "--seed", "1",
                     "--batch", "2"]) == 0
    out = capsys.readouterr()
    assert out.out.count("=== prompt 1, sample") == 2 and "\ndef " in out.out
    assert "tokens/s" in out.err
    # fp32 keys and values of 4 heads x 16 channels in each of 2 layers: 2 x 4 x (16 + 16) x 4 B
    assert "KV cache 1,024 B per token" in out.err
    # The same from the checkpoint file; a prompt longer than the context (64) is one line and exit 2.
    assert cli.main(["generate", str(run_dir / "checkpoints" / "last.ckpt"), "--prompt", "def ",
                     "--max-new-tokens", "12", "--seed", "1", "--batch", "2"]) == 0
    assert capsys.readouterr().out == out.out
    assert cli.main(["generate", str(run_dir), "--prompt", "x = 1\n" * 200]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.seq_len) is 64" in err
