"""Our GPT and tokenizer as lm-evaluation-harness's language model (`lm_eval.api.model.TemplateLM`, an `LM`).

The scoring follows lm-eval's own Hugging Face model (`lm_eval/models/huggingface.py`, HFLM) so a score here means
what it means there: TemplateLM splits each (context, continuation) pair (trailing spaces of the context move to the
continuation; an empty context becomes the prefix token, our end-of-document token, which is where every training
document starts from); inputs longer than the context are truncated from the left (the last model.seq_len + 1
tokens); rolling log-likelihoods use lm-eval's disjoint windows of model.seq_len tokens. Requests are sorted by
length, longest first (a batch too large for memory fails at once, not at the end), and run in batches, right-padded:
the model is causal, so padding after a sequence never changes its logits. Generation is greedy, recomputing the
whole window at each token (no KV cache), and stops at an `until` string, the end-of-document token or max_gen_toks.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from tokenizers import Tokenizer

from lit_pretrain.data.tokenizer import eod_id
from lit_pretrain.errors import DataError

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default for generate_until tasks that do not set max_gen_toks


class LitPretrainLM(TemplateLM):
    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, batch_size: int = 8,
                 device: Optional[torch.device] = None):
        """model: a plain GPT (model/gpt.py; `cfg.seq_len` is its context); tokenizer: the run's tokenizer.json."""
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        self.model, self._tokenizer, self.batch_size = model, tokenizer, batch_size
        self.max_length = model.cfg.seq_len
        self._device = device if device is not None else next(model.parameters()).device
        self.tokens_scored = 0
        """Input tokens run through the model so far (the cost an in-training evaluation reports)."""

    @property
    def eot_token_id(self) -> int:
        return eod_id(self._tokenizer)

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> List[int]:
        # Our tokenizer adds no special tokens (documents are only followed by EOD in the shards).
        return self._tokenizer.encode(string, add_special_tokens=False).ids

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self._tokenizer.decode(list(tokens))

    @torch.inference_mode()
    def _logits(self, rows: List[List[int]]) -> torch.Tensor:
        """(B, T, V) fp32 logits of right-padded rows (each at most max_length tokens)."""
        width = max(len(r) for r in rows)
        x = torch.zeros(len(rows), width, dtype=torch.long)  # pad id 0: positions after a row's end are never read
        for i, r in enumerate(rows):
            x[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        self.tokens_scored += sum(len(r) for r in rows)
        return self.model(x.to(self.device)).float()

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> List[Tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=True)  # a progress bar per evaluation floods train logs

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> List[Tuple[float, bool]]:
        """requests: ((context, continuation), context ids, continuation ids) → (sum of log-probs, is greedy)."""
        inputs, targets = [], []
        for _, context_ids, continuation_ids in requests:
            if not 1 <= len(continuation_ids) <= self.max_length:
                raise DataError(
                    f"a continuation of {len(continuation_ids)} tokens cannot be scored with model.seq_len="
                    f"{self.max_length}: it must have 1 to {self.max_length} tokens")
            whole = (list(context_ids) + list(continuation_ids))[-(self.max_length + 1):]  # left truncation, as HFLM
            inputs.append(whole[:-1])
            targets.append(list(continuation_ids))
        out: List[Optional[Tuple[float, bool]]] = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: -len(inputs[i]))
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            logits = self._logits([inputs[i] for i in batch])  # (B, T, V)
            for row, i in enumerate(batch):
                n, end = len(targets[i]), len(inputs[i])
                # (n, V): only the positions that predict the continuation need a log-softmax over the vocabulary.
                span = F.log_softmax(logits[row, end - n : end], dim=-1)
                want = torch.tensor(targets[i], device=span.device)
                out[i] = (float(span.gather(-1, want[:, None]).sum()), bool((span.argmax(-1) == want).all()))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        """Log-likelihood of whole strings (perplexity tasks), over disjoint windows as HFLM computes it."""
        windows, owner = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            for context_ids, continuation_ids in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context_ids, continuation_ids))
                owner.append(index)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[index] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        contexts, until, max_new = [], [], []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs: Dict = dict(gen_kwargs or {})
            stops = kwargs.get("until") or []
            until.append([stops] if isinstance(stops, str) else list(stops))
            max_new.append(int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS)))
            contexts.append(self.tok_encode(context) or [self.prefix_token_id])
        out: List[str] = [""] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: -len(contexts[i]))
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            texts = self._greedy([contexts[i] for i in batch], [max_new[i] for i in batch], [until[i] for i in batch])
            for i, text in zip(batch, texts):
                out[i] = text
        return out

    def _greedy(self, contexts: List[List[int]], max_new: List[int], until: List[List[str]]) -> List[str]:
        seqs, new = [list(c) for c in contexts], [[] for _ in contexts]
        done = [m <= 0 for m in max_new]
        while not all(done):
            active = [i for i, d in enumerate(done) if not d]
            rows = [seqs[i][-self.max_length:] for i in active]  # a window past the context slides (left truncation)
            logits = self._logits(rows)
            last = torch.tensor([len(r) - 1 for r in rows], device=logits.device)
            next_ids = logits[torch.arange(len(rows), device=logits.device), last].argmax(-1).tolist()
            for i, token in zip(active, next_ids):
                if token == self.eot_token_id:
                    done[i] = True
                    continue
                seqs[i].append(token)
                new[i].append(token)
                text = self.tok_decode(new[i])
                done[i] = len(new[i]) >= max_new[i] or any(s and s in text for s in until[i])
        texts = []
        for ids, stops in zip(new, until):
            text = self.tok_decode(ids)
            for s in stops:  # cut at the first stop string, as HFLM does
                if s:
                    text = text.split(s)[0]
            texts.append(text)
        return texts
