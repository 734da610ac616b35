"""Sampling from a trained GPT: KV-cache decoding, temperature, top-k, top-p, and `lit-pretrain generate`.

Prompts are decoded one after another (a per-prompt loop, no left-padding: every row of a batch has the same
prompt, so no row needs a padding mask and each row's positions start at 0 as in training); the `num_samples`
samples of one prompt decode together as one batch. Each row stops at its end-of-document token.
"""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from lit_pretrain.errors import ConfigError, DataError
from lit_pretrain.model.gpt import GPT


@dataclass
class Generation:
    tokens: List[List[int]]
    """New tokens of each sample, up to (without) its end-of-document token."""
    steps: int
    """Decoding steps taken: every row computes one token each step, finished or not."""
    seconds: float
    """Wall time of the prompt's forward and every step (sampling included)."""

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) * self.steps / self.seconds if self.seconds > 0 else float("inf")


def check_sampling(temperature: float, top_k: Optional[int], top_p: Optional[float]) -> None:
    if temperature < 0:
        raise ConfigError(f"--temperature {temperature}: choose >= 0 (0 is greedy decoding)")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"--top-k {top_k}: choose >= 1, or leave it out to keep every token")
    if top_p is not None and not 0 < top_p <= 1:
        raise ConfigError(f"--top-p {top_p}: choose in (0, 1], or leave it out to keep every token")


def next_token(logits: torch.Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
               top_p: Optional[float] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row of logits (B, V) -> (B,). temperature 0 is the argmax. Otherwise the logits are divided
    by the temperature, then cut to the top_k largest (ties with the k-th kept, as nanoGPT does), then to the
    nucleus: the most probable tokens whose mass first reaches top_p (Holtzman et al. 2019, "The Curious Case of
    Neural Text Degeneration", §3.1; at least one token always stays), then sampled from `generator`."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V) each
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # (B, V): mass of the tokens ranked above each
        drop = torch.zeros_like(mass_before, dtype=torch.bool).scatter(-1, order, mass_before >= top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)  # (B,)


def new_tokens_allowed(prompt_tokens: int, max_new_tokens: int, seq_len: int) -> int:
    """max_new_tokens cut so that prompt and new tokens fit in the context (model.seq_len), where RoPE's tables and
    the training windows end; a prompt that leaves no room is bad input."""
    if prompt_tokens < 1:
        raise ConfigError("--prompt encodes to no tokens: give at least one token of context")
    if prompt_tokens >= seq_len:
        raise ConfigError(f"--prompt is {prompt_tokens} tokens but the context (model.seq_len) is {seq_len}: "
                          f"shorten it to at most {seq_len - 1} tokens")
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {max_new_tokens}: choose >= 1")
    return min(max_new_tokens, seq_len - prompt_tokens)


@torch.inference_mode()
def generate(model: GPT, prompt: List[int], max_new_tokens: int, *, num_samples: int = 1, temperature: float = 1.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None,
             generator: Optional[torch.Generator] = None, eod_id: Optional[int] = None, use_cache: bool = True,
             step_logits: Optional[list] = None) -> Generation:
    """Continue `prompt` (token ids) `num_samples` times, at most max_new_tokens each (fewer where the context
    ends; see new_tokens_allowed). A row stops at eod_id; the batch stops when every row has.

    use_cache=False recomputes the whole prefix every step with the training forward: the reference the KV cache is
    tested and benchmarked against. step_logits, a list, receives each step's logits (num_samples, vocab_size).
    A finished row keeps decoding its own samples until the batch stops, so the generator's stream, and hence every
    other row, is the same with or without eod_id.
    """
    check_sampling(temperature, top_k, top_p)
    if num_samples < 1:
        raise ConfigError(f"--batch {num_samples}: choose >= 1")
    steps = new_tokens_allowed(len(prompt), max_new_tokens, model.cfg.seq_len)
    device = model.tok_embeddings.weight.device
    seq = torch.tensor(prompt, device=device).expand(num_samples, -1)  # (B, P)
    out = torch.empty(num_samples, steps, dtype=torch.long, device=device)  # (B, steps)
    lengths = torch.full((num_samples,), steps, device=device)  # (B,): new tokens before each row's EOD
    finished = torch.zeros(num_samples, dtype=torch.bool, device=device)  # (B,)
    start = time.perf_counter()
    if use_cache:
        cache = model.new_cache(num_samples, len(prompt) + steps)
        logits = model.forward_cached(seq, cache)  # (B, V)
    else:
        logits = model(seq)[:, -1]  # (B, V)
    taken = 0
    for i in range(steps):
        if step_logits is not None:
            step_logits.append(logits.clone())
        token = next_token(logits, temperature, top_k, top_p, generator)  # (B,)
        out[:, i] = token
        taken = i + 1
        if eod_id is not None:
            stops = (token == eod_id) & ~finished
            lengths[stops] = i
            finished |= stops
            if bool(finished.all()):  # a host sync per step: cheap next to a forward, and it saves whole steps
                break
        if taken == steps:
            break  # the last token is never fed back
        if use_cache:
            logits = model.forward_cached(token[:, None], cache)  # (B, V)
        else:
            seq = torch.cat([seq, token[:, None]], dim=1)  # (B, P + i + 1)
            logits = model(seq)[:, -1]  # (B, V)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    tokens = [row[:n].tolist() for row, n in zip(out, lengths.tolist())]
    return Generation(tokens=tokens, steps=taken, seconds=seconds)


def resolve(source) -> Tuple[Path, str]:
    """RUN_OR_CKPT -> (run folder, checkpoint name): a run folder reads its checkpoints/last.ckpt; a checkpoint
    file must lie in a run folder's checkpoints/, beside the config.yaml that names its tokenizer."""
    path = Path(source)
    if path.is_file():
        if path.parent.name != "checkpoints" or not (path.parent.parent / "config.yaml").is_file():
            raise DataError(f"checkpoint {path} lies outside a run folder's checkpoints/: generate needs the run's "
                            "config.yaml (its model and tokenizer); give runs/<name> or runs/<name>/checkpoints/X")
        return path.parent.parent, path.name
    if path.is_dir():
        if not (path / "config.yaml").is_file():
            raise DataError(f"{path} has no config.yaml: give a run folder (runs/<name>) or a checkpoint in one")
        return path, "last.ckpt"
    raise DataError(f"{path} does not exist: give a run folder (runs/<name>) or a checkpoint file in one")


def run_tokenizer(run_dir: Path):
    """The tokenizer a run trained on, from its config's data.prepared_dir, and its end-of-document id."""
    from lit_pretrain import config as config_lib
    from lit_pretrain.data.shards import run_tokenizer_entry
    from lit_pretrain.data.tokenizer import load_tokenizer

    saved = config_lib.load(run_dir / "config.yaml", check_inputs=False)  # its corpus may have moved since
    folder, tok = run_tokenizer_entry(saved.data)
    # eos_token=None: prepare checked the folder's end-of-document token (data.eos_token, any name); its id is here.
    return load_tokenizer(folder / tok["file"], eos_token=None), tok["eod_id"]


def prompt_ids(tokenizer, eod: int, text: str) -> List[int]:
    """The ids a prompt is decoded from: the end-of-document token first (in the token shards it precedes every
    document, so the prompt starts a document), then the text's. An exported tokenizer adds the same token
    (hf.exported_tokenizer), so transformers continues the same ids."""
    return [eod, *tokenizer.encode(text, add_special_tokens=False).ids]


def main(args) -> None:
    """`lit-pretrain generate`: print each sample (prompt + continuation), then the speed on stderr."""
    import sys

    from lit_pretrain.planning.memory import kv_cache_bytes_per_token
    from lit_pretrain.resume.weights import load_gpt

    check_sampling(args.temperature, args.top_k, args.top_p)
    run_dir, checkpoint = resolve(args.source)
    tokenizer, eod = run_tokenizer(run_dir)
    model = load_gpt(run_dir, checkpoint)
    if torch.cuda.is_available():
        model = model.cuda()
    device = model.tok_embeddings.weight.device
    generator = torch.Generator(device=device).manual_seed(args.seed)
    prompts = args.prompt or [""]
    total_tokens, total_seconds = 0, 0.0
    for p, text in enumerate(prompts):
        ids = prompt_ids(tokenizer, eod, text)
        seq_len = model.cfg.seq_len
        if len(ids) >= seq_len:
            raise ConfigError(f"--prompt {p + 1} is {len(ids) - 1} tokens (+1 end-of-document token put first) but "
                              f"the context (model.seq_len) is {seq_len}: shorten it to at most {seq_len - 2} tokens")
        if len(ids) + args.max_new_tokens > seq_len:
            print(f"lit-pretrain generate: prompt {p + 1} leaves room for {seq_len - len(ids)} new tokens in "
                  f"model.seq_len={seq_len}", file=sys.stderr)
        result = generate(model, ids, args.max_new_tokens, num_samples=args.batch, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, generator=generator, eod_id=eod)
        for s, row in enumerate(result.tokens):
            if len(prompts) * len(result.tokens) > 1:
                print(f"=== prompt {p + 1}, sample {s + 1} ===")
            print(text + tokenizer.decode(row))
        total_tokens += len(result.tokens) * result.steps
        total_seconds += result.seconds
    rate = total_tokens / total_seconds if total_seconds > 0 else float("inf")
    # the cache's size per token of context, every layer (latent attention keeps its latents, planning/memory.py)
    cache_bytes = kv_cache_bytes_per_token(model.cfg, model.tok_embeddings.weight.element_size())
    print(f"generated {total_tokens} tokens in {total_seconds:.2f} s: {rate:,.1f} tokens/s "
          f"({device.type}, KV cache {cache_bytes:,.0f} B per token, batch {args.batch})", file=sys.stderr)
