"""Typed config schemas: one dataclass per concern, each field documented where it is declared.

YAML may set only the fields that exist here (OmegaConf struct mode). Field metadata gives the range the
loader enforces: `ge`/`gt`/`le`/`lt` for numbers, `choices` for strings, `pattern` (a regular expression the whole
string must match, with `rule` saying it in words) for names.
"""

from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Union

from lit_pretrain.errors import ConfigError
from lit_pretrain.model.config import GPTConfig
from lit_pretrain.paths import SAFE_NAME, SAFE_NAME_RULE, is_safe_name

ModelConfig = GPTConfig


class Section:
    """Base of the config's sections: setting a name that is not one of the section's fields is refused, as
    OmegaConf's struct mode refused it, so a misspelt key in code (`c.trainer.max_step = 3`) fails where it is
    written instead of being kept beside the real one and never read."""

    def __setattr__(self, name: str, value) -> None:
        if name not in self.__dataclass_fields__ and not name.startswith("_"):
            raise AttributeError(f"{type(self).__name__} has no config key '{name}'")
        object.__setattr__(self, name, value)


@dataclass
class DeduplicationConfig(Section):
    exact: bool = True
    """Remove documents whose normalized text (below) is identical to an earlier document's (sha256 of it)."""
    lowercase: bool = False
    """Normalization: lower-case the text before hashing and shingling (case-only variants become duplicates)."""
    fold_whitespace: bool = True
    """Normalization: collapse every run of whitespace into one space and strip the ends (whitespace-only variants
    become duplicates). Unicode NFC is always applied."""
    near: bool = True
    """Remove near-duplicates: MinHash signatures of shingle sets, candidate pairs from LSH, clusters by union-find;
    the first document of each cluster in corpus order is kept."""
    shingle: str = field(default="word", metadata={"choices": ["word", "char"]})
    """Shingles are n-grams of words (whitespace-separated) or of characters."""
    shingle_size: int = field(default=5, metadata={"ge": 1})
    """n of the n-gram shingles (5 words by default; a document shorter than n is one shingle)."""
    num_perm: int = field(default=128, metadata={"ge": 2})
    """MinHash permutations: the signature length (the Jaccard estimate's std is sqrt(s(1-s)/num_perm))."""
    threshold: float = field(default=0.8, metadata={"gt": 0.0, "lt": 1.0})
    """Jaccard similarity of shingle sets at or above which two documents are near-duplicates."""
    false_negative_weight: float = field(default=0.9, metadata={"ge": 0.0, "le": 1.0})
    """Weight of missed pairs against false candidates when bands x rows is chosen (datasketch's optimum of the
    weighted error; 0.5 weighs both alike). High by default because `verify` removes false candidates cheaply,
    while a pair LSH misses is never seen again."""
    bands: Optional[int] = field(default=None, metadata={"ge": 2})
    """LSH bands b. null (with rows null): datasketch's optimum for (threshold, num_perm, weights)."""
    rows: Optional[int] = field(default=None, metadata={"ge": 1})
    """LSH rows per band r; set together with bands, and bands * rows <= num_perm."""
    verify: bool = True
    """Keep an LSH candidate pair only if its estimated Jaccard (share of equal signature values) reaches
    threshold; the report counts the candidates rejected (LSH false positives)."""
    seed: int = 1
    """Seed of the MinHash permutations: the same corpus and seed give the same kept set."""
    processes: Optional[int] = field(default=None, metadata={"ge": 1})
    """Processes that compute signatures, this one included (the others are workers started for the stage, which
    never import the caller's main module: lit_pretrain/data/preparation/workers.py). null: one per CPU core; 1: only
    this one. The kept set does not depend on it."""
    storage: str = field(default="memory", metadata={"choices": ["memory", "redis"]})
    """Where the LSH index lives: in this process, or in a Redis server (datasketch's redis storage) for corpora
    past one process's memory or an index shared by several processes or machines."""
    redis_host: str = "127.0.0.1"
    """storage=redis: the server's host."""
    redis_port: int = field(default=6379, metadata={"ge": 1, "le": 65535})
    """storage=redis: the server's port."""
    redis_db: int = field(default=0, metadata={"ge": 0})
    """storage=redis: the database number."""
    redis_basename: Optional[str] = None
    """storage=redis: key prefix of the index. null: a fresh prefix, deleted after the stage. Named: the index is
    kept under it for other processes to attach to, and must be empty when the stage starts."""

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Cross-field checks that a single field's range can't express (and the ranges, for direct callers)."""
        if not 0.0 < self.threshold < 1.0:
            raise ConfigError(
                f"data.deduplication.threshold={self.threshold} is outside (0, 1): it is a Jaccard similarity; "
                "0.8 is the usual near-duplicate threshold"
            )
        if (self.bands is None) != (self.rows is None):
            raise ConfigError(
                f"data.deduplication.bands={self.bands} and data.deduplication.rows={self.rows}: set both (an "
                "explicit LSH shape) or neither (datasketch's optimum for threshold and num_perm)"
            )
        if self.bands is not None and self.bands * self.rows > self.num_perm:
            raise ConfigError(
                f"data.deduplication.bands × rows = {self.bands} × {self.rows} = {self.bands * self.rows} exceeds "
                f"data.deduplication.num_perm={self.num_perm}: lower bands or rows, or raise num_perm"
            )


@dataclass
class SourceConfig(Section):
    """One source of a mixture (data.sources). Its corpus fields left null take the data.<same key> value; the
    tokenizer (data.tokenizer_path, vocab_size, tokenizer_train_bytes), shard_tokens and num_workers are shared."""

    name: str = ""
    """The source's name: metrics data/<name>/..., val/<name>/..., and its default prepared folder."""
    weight: float = 1.0
    """Relative share of the training windows drawn from this source (normalized over the sources; 0: none until a
    data.mixture_schedule entry raises it)."""
    max_epochs: Optional[float] = None
    """Passes over this source's train windows the run may make; a run that would go past it stops with an error
    before its first step. null: no limit (a small source repeats as often as its weight asks)."""
    prepared_dir: Optional[str] = None
    """This source's prepared folder. null: data.prepared_dir/<name>."""
    corpus: Optional[str] = None
    """As data.corpus (null: data.corpus)."""
    paths: Optional[List[str]] = None
    """As data.paths (null: data.paths)."""
    val_paths: Optional[List[str]] = None
    """As data.val_paths (null: data.val_paths)."""
    text_field: Optional[str] = None
    """As data.text_field (null: data.text_field)."""
    max_documents: Optional[int] = None
    """As data.max_documents (null: data.max_documents)."""
    val_fraction: Optional[float] = None
    """As data.val_fraction (null: data.val_fraction)."""
    split_seed: Optional[int] = None
    """As data.split_seed (null: data.split_seed)."""
    max_invalid_fraction: Optional[float] = None
    """As data.max_invalid_fraction (null: data.max_invalid_fraction)."""
    deduplication: Optional[DeduplicationConfig] = None
    """As data.deduplication (null: data.deduplication); deduplication runs within each source, not across them."""


@dataclass
class MixturePhase(Section):
    step: int = 0
    """These weights apply once this many optimizer steps are done (from trainer.global_step == step on), counted
    in global batches of the data order: batches a loss-spike rewind skipped count too."""
    weights: Dict[str, float] = field(default_factory=dict)
    """New weights by source name; a source not named keeps its weight from before."""


@dataclass
class DataConfig(Section):
    corpus: str = field(default="stdlib", metadata={"choices": ["stdlib", "text", "jsonl", "parquet", "megatron",
                                                                "numpy", "nanogpt"]})
    """Where documents come from. stdlib: the Python standard library's own .py files (on every machine,
    no download); text: plain text files, one document per file; jsonl: one JSON object per line, in .jsonl,
    .jsonl.gz or .jsonl.zst files; parquet: one row per document, text in column data.text_field. All are read as
    streams (data/preparation/readers.py); jsonl.zst and parquet need `pip install lit-pretrain[data]`.
    Corpora tokenized elsewhere, memory-mapped where they lie and trained on as they are (no prepare, no
    data.prepared_dir; data/pretokenized.py): megatron: Megatron-LM's PREFIX.bin + PREFIX.idx; numpy: OLMo-core's
    flat uint16/uint32 id files, with NAME.csv.gz document offsets beside them when present; nanogpt: nanoGPT's
    uint16 .bin files or llm.c's headed ones. They need data.tokenizer_path (the tokenizer the ids came from)."""
    paths: List[str] = field(default_factory=list)
    """Files, directories or glob patterns of the corpus (text and jsonl); directories are searched recursively.
    megatron: prefixes (or their .bin/.idx files); numpy, nanogpt: the id files. One path may be given as a string
    (`data.paths=/corpus`). Each entry must exist (relative: from the working directory) when the config loads
    (data/locate.py); data.corpus=stdlib takes none."""
    val_paths: List[str] = field(default_factory=list)
    """megatron, numpy, nanogpt only: files of the validation split (e.g. nanoGPT's val.bin). Empty: the last
    data.val_fraction of each file of data.paths (cut at a document boundary where the format has them)."""
    text_field: str = "text"
    """For jsonl: the key holding a document's text; for parquet: the column."""
    prepared_dir: str = "data/stdlib"
    """Folder for the tokenizer, shards and manifest. Reused when its manifest matches this data config;
    never overwritten."""
    vocab_size: int = field(default=8192, metadata={"ge": 259})
    """Byte-level BPE vocabulary size, including the 256 byte tokens and the end-of-document token."""
    tokenizer_path: Optional[str] = None
    """An existing Hugging Face tokenizer.json to use instead of training one (e.g. Llama 3's); it must hold
    data.eos_token, and data.bos_token when set."""
    tokenizer_train_bytes: int = field(default=16_000_000, metadata={"ge": 1})
    """Train the tokenizer on at most this many bytes of training documents (in corpus order)."""
    val_fraction: float = field(default=0.02, metadata={"gt": 0.0, "lt": 1.0})
    """Fraction of documents held out for validation, chosen by a seeded hash of the document id (pretokenized
    corpora: the last fraction of each file's tokens, unless data.val_paths is set)."""
    split_seed: int = 1234
    """Seed of the document-level train/validation split."""
    max_documents: Optional[int] = field(default=None, metadata={"ge": 1})
    """Use only the first N documents of the corpus (for quick experiments and tests)."""
    max_invalid_fraction: float = field(default=0.01, metadata={"ge": 0.0, "le": 1.0})
    """Prepare refuses a corpus when more than this fraction of its characters is invalid: U+FFFD that replaced
    bytes which are not UTF-8, or control characters (Unicode category Cc other than tab, line feed and carriage
    return), counted over the documents kept (data/preparation/quality.py). 1.0 accepts anything. A gate, not content:
    changing it does not change a prepared folder."""
    shard_tokens: int = field(default=1 << 25, metadata={"ge": 1024})
    """Tokens per shard file (a new shard starts at the next document after this many tokens)."""
    num_workers: int = field(default=0, metadata={"ge": 0})
    """DataLoader worker processes per rank (0: load in the training process)."""
    deduplication: DeduplicationConfig = field(default_factory=DeduplicationConfig)
    """Exact and MinHash near-duplicate removal before the split and the tokenizer (data/preparation/deduplicate.py)."""
    eos_token: str = "<|endoftext|>"
    """The end-of-document token written after every document: it must be in data.tokenizer_path's vocabulary
    (e.g. "<|end_of_text|>" for Llama 3); a trained tokenizer gets it as its special token."""
    bos_token: Optional[str] = None
    """Optional beginning-of-document token written before every document (e.g. "<|begin_of_text|>"); it must be in
    data.tokenizer_path's vocabulary; a trained tokenizer gets it as a second special token. null: none."""
    token_dtype: str = field(default="auto", metadata={"choices": ["auto", "uint16", "uint32"]})
    """Width of the ids in the shards. auto: uint16 up to 65,536 tokens, else uint32 (recorded in the manifest;
    readers use the manifest's). A vocabulary that does not fit the dtype chosen here is refused."""
    check_cache_dir: Optional[str] = "auto"
    """megatron, numpy, nanogpt: where the checks of each corpus file that passed are recorded, so a later start or
    restart does not read the whole corpus again (data/check_record.py). auto: $XDG_CACHE_HOME/lit-pretrain/
    corpus-checks (~/.cache when unset); a path: that folder; null: no record, every start reads every file."""
    tokenize_workers: int = field(default=1, metadata={"ge": 1})
    """Processes that tokenize documents into shards, this one included (the others are worker processes,
    lit_pretrain/data/preparation/workers.py). The shards are byte-identical for any number."""
    engine: str = field(default="local", metadata={"choices": ["local", "ray"]})
    """What runs prepare's reading, deduplication and tokenization: local (this process and its worker processes)
    or ray (tasks on a Ray cluster, lit_pretrain/data/preparation/ray_engine.py; `pip install lit-pretrain[ray]`). The
    prepared folder is byte-identical either way."""
    ray_address: Optional[str] = None
    """engine=ray: the cluster to run on. null: start a local one on this machine for the stage (data.workers
    CPUs); "auto": the cluster `ray start --head` started on this machine; HOST:PORT: that cluster's head."""
    workers: Optional[int] = field(default=None, metadata={"ge": 1})
    """engine=ray: Ray tasks run at once (null: one per CPU of the cluster); also the CPUs of the local cluster
    started when data.ray_address is null. The prepared folder does not depend on it."""
    document_masking: bool = False
    """Keep attention inside each document of a window and restart RoPE positions at each document's first token
    (the token after an end-of-document token), so a window holding two documents computes the second as if it
    were alone; the loss then skips the target after each end-of-document token (the next document's first token).
    Training only: it changes no prepared folder. Not supported with pipeline parallelism."""
    sources: List[SourceConfig] = field(default_factory=list)
    """A weighted mixture of sources, each with its own corpus and prepared folder (data/mixture.py), all tokenized
    by one tokenizer: data.tokenizer_path, or else the one trained on the first source. Empty: the single corpus
    described by the fields above."""
    mixture_schedule: List[MixturePhase] = field(default_factory=list)
    """Weight changes during the run, e.g. [{step: 800, weights: {web: 0.2, books: 0.8}}] for a decay-phase mix;
    entries in increasing step order."""
    shuffle_block_tokens: Optional[int] = field(default=None, metadata={"ge": 1})
    """The unit the training order shuffles, in tokens: each epoch permutes the blocks of this many consecutive
    tokens of each shard (seeded by run.seed and the epoch) and reads each block's windows one after another, so the
    order is one stream of tokens whatever model.seq_len is. A multiple of model.seq_len. null: model.seq_len (each
    window shuffled on its own). A context-extension stage (docs/resume.md) continues the data exactly at the
    next unseen token when both stages use the same value, a multiple of both seq_lens (e.g. the final context):
    set it from the first stage on. A shard's tail shorter than a block is not trained on. Single corpus only."""
    packing: str = field(default="concat", metadata={"choices": ["concat", "best_fit"]})
    """How training windows are cut from the documents (docs/data.md#best-fit-packing). concat: the shards read at
    a fixed stride, documents cut at every window edge. best_fit: each window filled with whole documents, the
    longest that fits first, from a buffer of data.packing_buffer documents; only the documents longer than a
    window, and one piece per window to fill it exactly, are cut (no padding: every position is a real token).
    Built at setup from the shards (no new prepared folder); validation windows stay concat's, so the validation
    loss of both is measured on the same windows."""
    packing_buffer: int = field(default=1000, metadata={"ge": 1})
    """data.packing=best_fit: documents held at once to choose from (nanochat's loader uses 1,000); more cuts fewer
    documents at a cost of memory and setup time."""
    shuffle: str = field(default="stored", metadata={"choices": ["stored", "feistel"]})
    """How an epoch's window order is drawn (docs/data.md#a-shuffle-in-constant-memory). stored: a seeded random
    permutation of all windows held in memory (8 bytes a window; the order of runs before this key, so their
    checkpoints resume exactly). feistel: the window at each position computed from the position by a seeded
    Feistel network with cycle-walking (Black & Rogaway 2002), memory independent of the corpus size. A resume
    under the other choice is refused (its data position counts windows of another order). Single corpus only."""

    def __post_init__(self):
        self.check_mixture()
        if self.corpus in ("megatron", "numpy", "nanogpt") and not self.sources and self.tokenizer_path is None:
            raise ConfigError(f"data.corpus={self.corpus} holds ids of another pipeline's tokenizer: set "
                              "data.tokenizer_path to that tokenizer.json (the ids are checked against it)")
        if self.val_paths and self.corpus not in ("megatron", "numpy", "nanogpt"):
            raise ConfigError(f"data.val_paths is for pretokenized corpora (megatron, numpy, nanogpt), not "
                              f"data.corpus={self.corpus}: unset it (data.val_fraction holds documents out)")
        if self.packing == "best_fit" and self.shuffle_block_tokens is not None:
            raise ConfigError("data.packing=best_fit packs whole documents into windows, data.shuffle_block_tokens "
                              "shuffles runs of consecutive tokens: unset data.shuffle_block_tokens (or use concat)")
        if self.shuffle == "feistel" and self.sources:
            raise ConfigError("data.shuffle=feistel orders a single corpus; a mixture (data.sources) draws each "
                              "source's windows in its own order: set data.shuffle=stored")

    def check_mixture(self) -> None:
        """The mixture's own rules, at config load (ranges of list items are not reached by config.check_ranges)."""
        names = []
        for i, src in enumerate(self.sources):
            key = f"data.sources[{i}]"
            if not is_safe_name(src.name):
                raise ConfigError(f"{key}.name={src.name!r}: expected {SAFE_NAME_RULE}")
            if src.name in names:
                raise ConfigError(f"{key}.name={src.name!r} names a source twice: give each source its own name")
            names.append(src.name)
            _check_weight(f"{key}.weight", src.weight)
            for name in ("corpus", "max_documents", "val_fraction", "max_invalid_fraction"):
                # The ranges and choices of the data.<name> field it stands in for.
                _check_meta(DataConfig, name, getattr(src, name), f"{key}.{name}")
            if src.max_epochs is not None and src.max_epochs <= 0:
                raise ConfigError(f"{key}.max_epochs={src.max_epochs}: expected a value > 0, or null for no limit")
        if self.mixture_schedule and not self.sources:
            raise ConfigError("data.mixture_schedule is set but data.sources is empty: list the sources it weighs")
        weights = {src.name: src.weight for src in self.sources}
        if self.sources and not any(weights.values()):
            raise ConfigError("data.sources: every weight is 0: give at least one source a weight > 0")
        last = 0
        for i, phase in enumerate(self.mixture_schedule):
            key = f"data.mixture_schedule[{i}]"
            if phase.step <= last:
                raise ConfigError(f"{key}.step={phase.step}: steps must be > 0 and increase from entry to entry")
            last = phase.step
            for name, weight in phase.weights.items():
                if name not in weights:
                    raise ConfigError(f"{key}.weights names {name!r}, which is not a source: use one of "
                                      f"{', '.join(weights)}")
                _check_weight(f"{key}.weights.{name}", weight)
            weights.update(phase.weights)
            if not any(weights.values()):
                raise ConfigError(f"{key}: every weight is 0 from step {phase.step} on: keep one source above 0")


PARAM_KINDS = ("embeddings", "head", "hidden", "norms", "biases")
"""Parameter kinds of optim.no_weight_decay and optim.lr_multipliers (optim.param_kind)."""


@dataclass
class OptimConfig(Section):
    lr_peak: float = field(default=1e-3, metadata={"gt": 0.0})
    """Learning rate at the end of warmup."""
    weight_decay: float = field(default=0.1, metadata={"ge": 0.0})
    """AdamW decoupled weight decay, applied to weight matrices only (not norms, biases or embeddings)."""
    beta1: float = field(default=0.9, metadata={"ge": 0.0, "lt": 1.0})
    """AdamW first-moment decay."""
    beta2: float = field(default=0.95, metadata={"ge": 0.0, "lt": 1.0})
    """AdamW second-moment decay (0.95 as in GPT-3 and LLaMA; 0.999 is less stable at scale)."""
    eps: float = field(default=1e-8, metadata={"gt": 0.0})
    """AdamW epsilon."""
    grad_clip_norm: float = field(default=1.0, metadata={"ge": 0.0})
    """Gradient clipping: rescale the whole gradient so its global L2 norm is at most this. 0 disables."""
    name: str = field(default="adamw", metadata={"choices": ["adamw", "muon", "sgd"]})
    """adamw; muon: Muon (Jordan et al. 2024, torch.optim.Muon) for the 2-D hidden matrices of the blocks and AdamW
    for embeddings, head, norms and biases, as the Muon authors prescribe; under every strategy (ZeRO stages 2/3 and
    tensor parallelism gather each matrix for its Newton-Schulz step: optim.whole_matrix_muon_step); sgd: SGD with
    `momentum` (its weight decay is L2, coupled to the gradient, as torch.optim.SGD's)."""
    momentum: float = field(default=0.95, metadata={"ge": 0.0, "lt": 1.0})
    """Momentum of muon's hidden matrices (0.95, the Muon authors' value, Nesterov) and of sgd."""
    muon_adjust_lr: str = field(default="match_rms_adamw", metadata={"choices": ["match_rms_adamw", "original"]})
    """muon: how each matrix's rate is scaled by its shape. match_rms_adamw: lr x 0.2 sqrt(max(A, B)), the update's
    RMS of AdamW's, so lr_peak and weight_decay tuned for AdamW carry over (Liu et al. 2025, "Muon is Scalable for
    LLM Training", §2.2); original: lr x sqrt(max(1, A/B)) (Jordan et al. 2024; use lr_peak ~0.02 then)."""
    z_loss: float = field(default=0.0, metadata={"ge": 0.0})
    """Coefficient of the auxiliary loss z_loss x log(Z)^2, Z the softmax normalizer of the final logits (PaLM,
    Chowdhery et al. 2022 §5: 1e-4), which keeps log Z near 0. Logged apart as train/z_loss; train/loss stays the
    task loss. 0: off."""
    no_weight_decay: List[str] = field(default_factory=lambda: ["embeddings", "norms", "biases"])
    """Parameters left undecayed: parameter kinds (embeddings, head, hidden, norms, biases) or fnmatch patterns over
    parameter names (e.g. "blocks.*.attn.wo.weight"). The default decays the hidden matrices and an untied head
    (GPT-3 §B, nanoGPT); a tied head is the embedding."""
    lr_multipliers: Dict[str, float] = field(default_factory=dict)
    """Learning-rate factor per parameter kind (embeddings, head, hidden, norms, biases), e.g. {embeddings: 10}:
    the schedule scales each kind's lr_peak x factor. model.init=mup multiplies hidden by model.mup_base_width /
    d_model on top (lit_pretrain/model/init.py). Unnamed kinds: 1."""

    def check(self) -> None:
        """Cross-key rules, at config load (config.check_ranges). optim.name=muon runs under every parallel plan
        (tests/parallel/test_mesh_parallel.py's muon cases), so no plan is refused here."""
        for kind, factor in self.lr_multipliers.items():
            if kind not in PARAM_KINDS:
                raise ConfigError(f"optim.lr_multipliers.{kind}: unknown parameter kind; expected one of "
                                  f"{list(PARAM_KINDS)}")
            if not factor > 0:
                raise ConfigError(f"optim.lr_multipliers.{kind}={factor}: expected a factor > 0")


@dataclass
class StageScheduleConfig(Section):
    """A stage's own learning-rate schedule (schedule.stage): from the rate the previous stage reached, at the step
    of the checkpoint run.resume continues, to lr_min at the stage's last step (trainer.max_steps), as Llama 3
    anneals to 0 (Dubey et al. 2024, §3.4.3) and OLMo 2 its mid-training stage (Team OLMo 2024); docs/
    resume.md, "Stages". Recorded in each checkpoint, so a resume inside the stage continues it exactly."""

    kind: str = field(default="linear", metadata={"choices": ["linear", "cosine", "1-sqrt", "constant"]})
    """The decay's shape: linear, cosine (half a cosine), 1-sqrt (Hägele et al. 2024) or constant (the rate reached,
    held; lr_min unused)."""
    lr_min: float = field(default=0.0, metadata={"ge": 0.0})
    """Learning rate at the stage's last step: 0 (an anneal to zero) or a floor."""

    def __post_init__(self):
        # schedule.stage is optional, and config.py's range check does not descend into an optional section.
        if self.kind not in ("linear", "cosine", "1-sqrt", "constant") or not self.lr_min >= 0:
            raise ConfigError(f"schedule.stage={{kind: {self.kind}, lr_min: {self.lr_min}}}: expected kind one of "
                              "linear, cosine, 1-sqrt, constant and lr_min >= 0")


@dataclass
class ScheduleConfig(Section):
    kind: str = field(default="cosine", metadata={"choices": ["cosine", "linear", "wsd", "constant"]})
    """Decay after warmup: cosine, linear, wsd (warmup-stable-decay) or constant."""
    warmup_steps: int = field(default=100, metadata={"ge": 0})
    """Optimizer steps of linear learning rate warmup from 0 to optim.lr_peak."""
    lr_min: float = field(default=1e-4, metadata={"ge": 0.0})
    """Learning rate at the last step (cosine, linear, wsd)."""
    decay_fraction: float = field(default=0.2, metadata={"gt": 0.0, "le": 1.0})
    """wsd only: fraction of trainer.max_steps spent in the final linear decay (Hu et al. 2024, MiniCPM)."""
    decay_shape: str = field(default="linear", metadata={"choices": ["linear", "1-sqrt"]})
    """wsd only: the decay's shape, linear or 1-sqrt (lr_min + (lr_peak - lr_min)·(1 - sqrt(progress)), Hägele et
    al. 2024, the cooldown they find best; lit_pretrain/optim/schedule.py)."""
    stage: Optional[StageScheduleConfig] = None
    """A stage's own schedule, from the rate the checkpoint it resumes had reached (a cooldown or anneal stage; needs
    run.resume and schedule.stage in run.resume_allow_changes). null: the schedule continues across a resume: a
    changed trainer.max_steps (or schedule.*) recomputes it where that leaves the rate where it was (in warmup, in
    wsd's stable phase), else the decay still ahead is spread from the rate reached over the new steps
    (lit_pretrain/optim/stages.py; docs/resume.md, "Stages")."""

    def __post_init__(self):
        if self.decay_shape != "linear" and self.kind != "wsd":
            raise ConfigError(f"schedule.decay_shape={self.decay_shape} shapes the decay of schedule.kind=wsd only "
                              f"(this run's is {self.kind}): set schedule.kind=wsd or drop schedule.decay_shape")


LOGGERS = ("csv", "tensorboard", "wandb")


@dataclass
class ProfileConfig(Section):
    start_step: int = field(default=5, metadata={"ge": 0})
    """Optimizer steps completed before the window opens (trainer.global_step), so the trace holds the steps that
    metrics.csv numbers start_step + 1 .. start_step + steps: the first steps are atypical (allocations, lazy
    initialization), so the default skips five."""
    steps: int = field(default=3, metadata={"ge": 1})
    """Optimizer steps profiled (all their micro-batches, and any validation that falls inside)."""

    def __post_init__(self):
        # trainer.profile is optional, and config.py's range check does not descend into an optional section.
        if self.start_step < 0 or self.steps < 1:
            raise ConfigError(f"trainer.profile={{start_step: {self.start_step}, steps: {self.steps}}}: expected "
                              "start_step >= 0 and steps >= 1")


@dataclass
class Float8Config(Section):
    """FP8 training of the blocks' linear layers through torchao (trainer.float8; null: none): each converted linear
    casts its input, weight and output gradient to float8 e4m3 with dynamic scales and multiplies in fp8, keeping the
    fp32 master weight (Micikevicius et al. 2022, "FP8 formats for deep learning"; torchtitan's float8 section).
    A numeric format of the step, like trainer.precision beside it, not part of the architecture: applied from
    outside the GPT (lit_pretrain/parallel/float8.py) through the plan, which carries it as it carries
    trainer.compile; checkpoints hold the same weights, names and dtypes as without it. The output head, and any
    linear with a dimension not divisible by 16 (torch._scaled_mm's requirement), stay in bf16, as torchtitan and
    OLMo-core do.
    Needs `pip install lit-pretrain[fp8]` (torchao 0.18)."""

    recipe: str = field(default="rowwise", metadata={"choices": ["rowwise", "tensorwise", "rowwise_with_gw_hp"]})
    """torchao's scaling recipe. rowwise (torchtitan's default): one scale per row of each operand, powers of 2;
    tensorwise: one scale per tensor (the fastest: +25% vs +10% for rowwise at Llama 3 8B on 8 H100, torchao's
    figures); rowwise_with_gw_hp: rowwise, with the weight gradient computed in bf16 (the most accurate)."""
    fsdp_float8_all_gather: bool = False
    """recipe=tensorwise under FSDP2 (strategy.zero_stage 2 or 3) on CUDA only: gather the weights already cast to
    fp8 (half the bytes of bf16). false: FSDP2 gathers the weights as today and each linear casts them itself."""
    exclude: List[str] = field(default_factory=list)
    """More linears to keep in bf16, by name (`blocks.0.attn.wq`) or by the name in every block (`attn.wo`,
    `mlp.w_down`), as torchtitan's filter_fqns; each must name a converted linear."""


@dataclass
class BatchChange(Section):
    at_step: int = field(default=0, metadata={"ge": 0})
    """The first optimizer step (trainer.global_step, 0-based) trained at this batch; the first entry's is 0."""
    tokens_per_step: int = field(default=1, metadata={"ge": 1})
    """Global tokens per optimizer step from at_step on (as trainer.tokens_per_step)."""


@dataclass
class TrainerConfig(Section):
    max_steps: int = field(default=1000, metadata={"ge": 1})
    """Optimizer steps to train for (after gradient accumulation)."""
    micro_batch_size: int = field(default=8, metadata={"ge": 1})
    """Sequences per forward/backward on one device."""
    tokens_per_step: Optional[int] = field(default=None, metadata={"ge": 1})
    """Global tokens per optimizer step, the same under every layout. null: micro_batch_size x model.seq_len, one
    micro-batch of one process (whatever the layout). It must be a multiple of micro_batch_size x model.seq_len x
    the data-parallel degree (strategy.data_parallel_replicate x data_parallel_shard: tensor- and pipeline-parallel
    ranks share their replica's batch); the quotient is the gradient accumulation count. A layout that does not
    divide it is refused when the config loads, naming the micro_batch_size and tokens_per_step that work
    (planning/batch.py)."""
    tokens_per_param: Optional[float] = field(default=None, metadata={"gt": 0.0})
    """The token budget as a tokens-per-parameter ratio (Hoffmann et al. 2022: about 20 is compute-optimal): the run
    trains for ceil(tokens_per_param x parameters / tokens_per_step) optimizer steps, which replace max_steps; the
    parameters are counted from the architecture table (model.vocab_size, or data.vocab_size while it is null).
    Needs tokens_per_step; a run file or command line that sets max_steps as well is refused (set
    trainer.tokens_per_param=null to give steps instead). null: max_steps as given."""
    batch_schedule: List[BatchChange] = field(default_factory=list)
    """A global batch that changes during training, by optimizer step: e.g. [{at_step: 0, tokens_per_step: 4096},
    {at_step: 100, tokens_per_step: 8192}] (docs/scaling.md, "A batch-size schedule"). The first entry is at step 0,
    steps increase. The accumulation is fixed for the run, set by the largest entry (trainer.tokens_per_step must be
    null or equal to it) and trainer.micro_batch_size; the micro-batch shrinks for the smaller entries, so each must
    be a multiple of model.seq_len x data-parallel degree x accumulation (refused at load otherwise). Windows of the
    data order are consumed step by step (planning/batch_schedule.py), exact across a change and a resume on any
    layout. Not with data.sources, pipeline parallelism or trainer.tokens_per_param. []: trainer.tokens_per_step
    every step."""
    batch_schedule_lr: str = field(default="sqrt", metadata={"choices": ["sqrt", "linear", "none"]})
    """How the learning rate follows trainer.batch_schedule: optim.lr_peak (and the whole schedule) is for the first
    entry's batch, scaled by sqrt(batch / first batch) (Malladi et al. 2022, for Adam), by batch / first batch
    (linear, Goyal et al. 2017, for SGD) or not at all (none)."""
    accelerator: str = field(default="auto", metadata={"choices": ["auto", "cpu", "gpu", "cuda"]})
    """Lightning accelerator."""
    devices: int = field(default=1, metadata={"ge": 1})
    """Devices (processes) per node."""
    num_nodes: int = field(default=1, metadata={"ge": 1})
    """Nodes."""
    precision: str = field(default="32-true", metadata={"choices": ["32-true", "bf16-mixed", "16-mixed", "bf16-true"]})
    """Lightning precision. bf16-mixed runs the step's matmuls and attention in bf16 under torch.autocast on fp32
    weights; the loss, the gradients (their norm and clipping) and AdamW's state stay fp32
    (tests/parallel/test_bf16.py). On CPUs with bf16 instructions (avx512_bf16 or AMX in /proc/cpuinfo) it is the faster
    choice (`make bench CASES=precision`, README "Performance"); without them bf16 is emulated and many times slower
    than 32-true. bf16-true keeps the weights and AdamW's moments in bf16 as well: updates smaller than a bf16 ulp of a
    weight are lost, and it trains measurably worse."""
    float8: Optional[Float8Config] = None
    """FP8 training of the blocks' linears through torchao (Float8Config), with trainer.precision=bf16-mixed for the
    other ops; null: none (the linears run in trainer.precision). Formerly model.float8, still read with a rename
    notice."""
    num_threads: Optional[int] = field(default=None, metadata={"ge": 1})
    """torch intra-op threads per process. null: the cores divided by the processes on this node."""
    val_every_n_steps: int = field(default=200, metadata={"ge": 1})
    """Run validation every this many optimizer steps (and once at the end)."""
    val_windows: int = field(default=160, metadata={"ge": 1})
    """Validation windows (of model.seq_len + 1 tokens) each time, in all: the first val_windows of the validation
    split (fewer if it is smaller; of each source, for a mixture), one fixed set for any number of processes and any
    layout, split across the data-parallel ranks (data/validation.py). val/loss is the mean over all their predicted
    tokens. Replaces trainer.val_batches (batches per device, so the set grew with the processes)."""
    log_every_n_steps: int = field(default=10, metadata={"ge": 1})
    """Write metrics every this many optimizer steps; without a terminal (a log file) also print a line then: step,
    training loss, tokens/s, MFU, time left (lit_pretrain/callbacks/console.py)."""
    checkpoint_every_n_steps: int = field(default=500, metadata={"ge": 0})
    """Save a checkpoint every this many optimizer steps (0: only the final one)."""
    progress_bar: bool = True
    """Show Lightning's progress bar when stdout is a terminal; otherwise (a log file) print a line every
    log_every_n_steps steps and one per validation instead of the bar's redraws (lit_pretrain/callbacks/console.py)."""
    compile: Union[bool, str] = field(default="auto", metadata={"choices": [True, False, "auto"]})
    """torch.compile of the training step (parallel/compile.py: each block's forward and the loss). The first steps
    pay the compile time (tens of seconds on a cold cache), later ones run faster. auto: compile when a C++
    compiler is found (inductor builds its kernels with it), no tensor or pipeline parallelism is used and
    max_steps is long enough to pay the compile time back (planning/compile_policy.py); `train` prints which and
    why just before training. true needs a C++ compiler."""
    loggers: List[str] = field(default_factory=lambda: ["csv", "tensorboard"])
    """Where metrics go: csv (runs/<name>/metrics.csv, required: resume and the summary read it), tensorboard
    (runs/<name>/tensorboard/; skipped with a notice when tensorboard is not installed), wandb (Weights & Biases,
    files under runs/<name>/wandb/; WANDB_MODE=offline keeps it off the network). Extras: lit-pretrain[logging]."""
    profile: Optional[ProfileConfig] = None
    """Record a PyTorch profiler trace of a few optimizer steps into runs/<name>/profile/ (callbacks/profile.py),
    e.g. {start_step: 5, steps: 3}. null: no profiling."""
    device_memory_gb: Optional[float] = field(default=None, metadata={"gt": 0.0})
    """Memory of one device in GB (1e9 bytes), e.g. 141 for an H200, 80 for an H100. When set, the run's per-device
    memory plan (planning/run_plan.py: model states, autocast's weight copies, activations, logits, transient
    buffers) must leave planning.run_plan.MIN_HEADROOM of it free, checked when the config loads (`show`, `train`,
    `lit-pretrain memory --run`); the error says what to change. null: not checked."""

    def __post_init__(self):
        if isinstance(self.float8, dict):  # from a checkpoint's plain hyperparameters (dataclasses.asdict)
            self.float8 = Float8Config(**self.float8)
        self.check()

    def check(self) -> None:
        unknown = [name for name in self.loggers if name not in LOGGERS]
        if unknown:
            raise ConfigError(f"trainer.loggers={list(self.loggers)}: unknown logger {unknown[0]!r}; choose from "
                              f"{', '.join(LOGGERS)}")
        if "csv" not in self.loggers:
            raise ConfigError(f"trainer.loggers={list(self.loggers)} lacks csv: resume and the run summary read "
                              "metrics.csv; add csv to the list")
        if len(set(self.loggers)) != len(self.loggers):
            raise ConfigError(f"trainer.loggers={list(self.loggers)} names a logger twice: name each once")
        self.check_batch_schedule()

    def check_batch_schedule(self) -> None:
        for i, change in enumerate(self.batch_schedule):
            if isinstance(change, dict):  # from a checkpoint's plain hyperparameters (dataclasses.asdict)
                self.batch_schedule[i] = change = BatchChange(**change)
            previous = self.batch_schedule[i - 1].at_step if i else None
            if (i == 0 and change.at_step != 0) or (i and change.at_step <= previous):
                raise ConfigError(f"trainer.batch_schedule[{i}].at_step={change.at_step}: the first entry is at step "
                                  "0 and the steps increase from entry to entry")
        if not self.batch_schedule:
            return
        top = max(change.tokens_per_step for change in self.batch_schedule)
        if self.tokens_per_step not in (None, top):
            raise ConfigError(f"trainer.tokens_per_step={self.tokens_per_step} with trainer.batch_schedule (largest "
                              f"batch {top}): the schedule gives the batch of each step; set trainer.tokens_per_step="
                              f"null (or {top}, the largest entry, which sets the accumulation)")
        if self.tokens_per_param is not None:
            raise ConfigError("trainer.tokens_per_param with trainer.batch_schedule: the steps of a token budget "
                              "depend on the batch; give trainer.max_steps (tokens_per_param=null)")


@dataclass
class PipelineConfig(Section):
    micro_batches: int = field(default=4, metadata={"ge": 1})
    """Pipeline micro-batches (m) each trainer.micro_batch_size batch is cut into; the bubble is (p-1)/(m+p-1)."""
    schedule: str = field(default="1f1b", metadata={"choices": ["gpipe", "1f1b", "interleaved_1f1b"]})
    """torch.distributed.pipelining schedule: gpipe (all forwards, then all backwards), 1f1b, interleaved_1f1b."""
    stages_per_rank: int = field(default=1, metadata={"ge": 1})
    """Stages each pipeline rank holds (v): 1 for gpipe and 1f1b, 2 or more for interleaved_1f1b."""


@dataclass
class StrategyConfig(Section):
    name: str = field(default="single", metadata={"choices": ["single", "ddp", "zero", "fsdp", "tensor", "pipeline"]})
    """The preset this section started from (experiments/strategy/<name>.yaml). The work is split by the degrees
    below (lit_pretrain/planning/plan.py); the name only decides what they leave unset: single refuses more than
    one process, zero and fsdp default zero_stage to 3, the others to 0."""
    zero_stage: Optional[int] = field(default=None, metadata={"ge": 0, "le": 3})
    """ZeRO stage of the data-parallel ranks: 0 none (replicas all-reduce gradients), 1 optimizer state sharded
    (ZeroRedundancyOptimizer over data_parallel_shard x context_parallel; no replicas, tensor, pipeline or expert
    parallelism), 2 also gradients (FSDP2, parameters kept gathered from
    forward to backward), 3 also parameters (FSDP2, resharded after forward). null: 3 for name=zero or fsdp,
    else 0."""
    data_parallel_replicate: Optional[int] = field(default=None, metadata={"ge": -1})
    """Data-parallel replicas (HSDP replica groups when data_parallel_shard > 1). -1: the rest of the world.
    null: the rest when zero_stage is 0, else 1."""
    data_parallel_shard: Optional[int] = field(default=None, metadata={"ge": -1})
    """Data-parallel ranks that shard model state at zero_stage (>= 1). -1: the rest of the world. null: the rest
    when zero_stage >= 1, else 1."""
    process_group_backend: Optional[str] = field(default=None, metadata={"choices": [None, "gloo", "nccl"]})
    """torch.distributed backend. null: gloo on CPU, nccl on GPUs."""
    timeout_seconds: int = field(default=1800, metadata={"ge": 1})
    """Process-group timeout: how long a rank waits for its peers in a collective before failing. Kept long: it
    also bounds legitimate waits (rank 0 alone running downstream evaluation or writing a large checkpoint); a dead,
    stopped or hung peer is caught sooner by the watchdog (peer_failure_timeout_seconds, hang_timeout_seconds)."""
    startup_timeout_seconds: float = field(default=300.0, metadata={"gt": 0})
    """How long every rank may take to join the rendezvous at start-up (torchtitan's default, 300 s), bounded apart
    from timeout_seconds: a rank that never arrives ends the job with one line naming it (lit_pretrain/launch/
    startup.py, exit code 3). Raise it where nodes start slowly (large images, cold file systems)."""
    peer_failure_timeout_seconds: float = field(default=10.0, metadata={"ge": 0})
    """Watchdog (lit_pretrain/launch/watchdog.py): a rank whose heartbeat stops this long (killed, stopped, its node
    lost; a process gone on the same host is seen within a second) ends the job on every rank, with one line naming
    it and its step (exit code 3). Heartbeats go through the rendezvous store every min(1, this / 5) s. 0: no
    watchdog (a failed peer then surfaces as the backend's own error, or after timeout_seconds)."""
    hang_timeout_seconds: float = field(default=900.0, metadata={"ge": 0})
    """Watchdog: every rank alive but none finished a micro-batch for this long is a hang: the rank(s) behind are
    named, each rank's Python stack is written to runs/<name>/stacks/rank<r>.txt, and the job ends. Must exceed the
    longest legitimate pause (first compile, a checkpoint write, rank 0's downstream evaluation); half of
    timeout_seconds by default, so the report comes before the collective times out. 0: no hang detection."""
    tensor_parallel: int = field(default=1, metadata={"ge": -1})
    """Ranks that split each block's weight matrices (t; -1: the rest). Divides model.n_heads and the MLP width."""
    pipeline_parallel: int = field(default=1, metadata={"ge": -1})
    """Pipeline stages, each a contiguous slice of the blocks (p; -1: the rest)."""
    sequence_parallel: bool = False
    """With tensor_parallel > 1: shard the norms and the residual stream along the sequence across the tensor-
    parallel group (Korthikanti et al. 2022), all-gather / reduce-scatter in place of all-reduce."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Pipeline schedule settings (used when pipeline_parallel > 1)."""
    expert_parallel: int = field(default=1, metadata={"ge": 1})
    """model.moe only: data-parallel ranks that split the routed experts (P): each holds E/P experts of every MoE
    layer (parameters, gradients, optimizer state) and computes them for its group's tokens, exchanged by
    all-to-all (lit_pretrain/parallel/expert.py). Divides the data-parallel degree D (D x context_parallel: those
    ranks route different tokens too); the D/P ranks holding the same experts are their own data-parallel group
    (FSDP2 shards them over it at zero_stage 2/3). Composes with context_parallel,
    tensor_parallel (each expert split along its width over it: E/P experts x 1/t of their width a rank) and
    pipeline_parallel; not with zero_stage 1. 1: off."""
    mixed_precision_policy: Optional[bool] = None
    """zero_stage 2/3 (FSDP2, HSDP included) with trainer.precision=bf16-mixed: FSDP2's MixedPrecisionPolicy, as
    torchtitan and OLMo-core run it: parameters gathered in bf16 (half the all-gather bytes), the blocks computed in
    bf16 with the norms in fp32, gradients reduced in fp32; master weights and AdamW state stay fp32, and Lightning's
    autocast is off (nothing left for it to cast). null (default): on wherever it is built (ZeRO-2/3 and HSDP
    without tensor, pipeline, expert or context parallelism), the autocast path elsewhere; true: on, refused where
    not built; false: fp32 parameters gathered and autocast per op. `train`'s plan line says which ran."""
    context_parallel: int = field(default=1, metadata={"ge": 1})
    """Ranks that share one micro-batch and split its sequence (c; Llama 3's context parallelism, lit_pretrain/
    parallel/context.py): each computes 2 of 2c chunks of the window (chunks r and 2c-1-r, which balances the causal
    work), all-gathers the keys and values of every layer over the group and attends with the causal and document
    mask in global positions. Activations per rank fall by c. Not a data-parallel degree (trainer.tokens_per_step
    is split over data_parallel_replicate x data_parallel_shard only), but FSDP2 (zero_stage 2/3) shards the model
    state over data_parallel_shard x context_parallel, as ZeroRedundancyOptimizer does the optimizer state at
    zero_stage 1. Needs model.seq_len divisible by 2c (2c x tensor_parallel with sequence_parallel). Composes with
    zero_stage 1/2/3, HSDP, tensor_parallel (with sequence_parallel),
    pipeline_parallel and model.moe, with expert_parallel over data-parallel x context-parallel ranks (the routing
    counts summed over the group; docs/strategies.md). 1: off."""
    activation_checkpointing: str = field(default="none",
                                          metadata={"choices": ["none", "full", "every_k", "selective"]})
    """Recompute whole blocks in the backward pass instead of saving their activations: none, full (every block)
    or every_k (blocks 0, k, 2k, ...); or selective, torchtitan's op-level policy: every block keeps its matmul and
    attention outputs and recomputes only the cheap ops between them (norms, RoPE, activations); with model.moe also
    the router's, the grouped experts' and the router's top-k (the recomputation routes as the forward did). A memory
    choice of the layout, like zero_stage: the plan carries it and lit_pretrain.parallel applies it from outside the
    GPT (formerly model.activation_checkpointing, still read with a rename notice)."""
    activation_checkpointing_k: int = field(default=2, metadata={"ge": 1})
    """activation_checkpointing=every_k only: checkpoint one block in every k."""
    activation_checkpointing_save_matmuls: str = field(default="all", metadata={"choices": ["all", "every_other"]})
    """activation_checkpointing=selective only: keep every matmul's output (all), or the 1st, 3rd, ... of each
    block's (every_other, as torchtitan's save list does: less memory, half the matmuls' forward run again)."""


@dataclass
class CallbackSpec(Section):
    class_path: str = ""
    """A user's own Lightning callback as `module:Class` (the only import string a config may hold), imported when
    the config loads: the module is looked up on sys.path (PYTHONPATH), then in the run file's folder, then in the
    working directory (config.py: import_user_module)."""
    init_args: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for its constructor (plain data)."""


@dataclass
class LossSpikeConfig(Section):
    enabled: bool = False
    """Detect loss spikes (callbacks/loss_spike.py), act on them and label each `recovered` or `divergence`."""
    window: int = field(default=100, metadata={"ge": 5})
    """Steps in the rolling window whose median and 1.4826 × MAD are the baseline and the robust spread."""
    watch_steps: int = field(default=100, metadata={"ge": 0})
    """Steps at the start that are only watched (filling the window), never flagged."""
    threshold_sigmas: Optional[float] = field(default=6.0, metadata={"gt": 0.0})
    """Flag a step whose loss is more than this many robust standard deviations above the baseline. null: unused."""
    threshold_ratio: Optional[float] = field(default=None, metadata={"gt": 1.0})
    """Flag a step whose loss exceeds this multiple of the baseline. null: unused. When both thresholds are set,
    a spike must pass both."""
    on_grad_norm: bool = False
    """Apply the same rule to the pre-clip gradient norm (its own window) as well."""
    action: str = field(default="skip_step", metadata={"choices": ["log", "skip_step", "rewind", "stop"]})
    """log: record only; skip_step: drop the flagged step's update (and later flagged ones until it resolves);
    rewind: restore the state of about rewind_steps earlier and skip skip_batches batches; stop: end the run."""
    rewind_steps: int = field(default=100, metadata={"ge": 0})
    """Rewind to the newest rewind point at least this many steps before the spike (PaLM §5.1: about 100)."""
    rewind_every_n_steps: int = field(default=50, metadata={"ge": 1})
    """Take an in-memory rewind point (each rank's module and optimizer state) every this many steps."""
    skip_batches: int = field(default=200, metadata={"ge": 0})
    """Global batches (optimizer steps' worth of data) skipped after a rewind (PaLM §5.1: 200 to 500)."""
    lr_scale: float = field(default=1.0, metadata={"gt": 0.0, "le": 1.0})
    """After a rewind, multiply the learning rate by this for lr_scale_steps steps (1: unchanged)."""
    lr_scale_steps: int = field(default=0, metadata={"ge": 0})
    """Steps the lowered learning rate lasts after a rewind."""
    recovery_steps: int = field(default=50, metadata={"ge": 1})
    """An event is `recovered` if within this many steps the loss is back within recovery_tolerance of its
    pre-spike level, else `divergence`."""
    recovery_tolerance: float = field(default=0.05, metadata={"ge": 0.0})
    """Relative tolerance: back means loss <= baseline × (1 + recovery_tolerance)."""
    on_divergence: str = field(default="stop", metadata={"choices": ["log", "rewind", "stop"]})
    """What a divergence triggers."""
    max_rewinds: int = field(default=3, metadata={"ge": 0})
    """Stop instead of rewinding once this many rewinds were made."""


@dataclass
class NanGuardConfig(Section):
    enabled: bool = False
    """Drop any update whose loss or gradient is NaN or Inf (callbacks/nan_guard.py)."""
    max_consecutive: int = field(default=5, metadata={"ge": 1})
    """Stop the run after this many such steps in a row."""
    check_gradients: bool = True
    """Check the global gradient norm as well as the loss."""


@dataclass
class GradientNormConfig(Section):
    enabled: bool = False
    """Log the pre-clip global gradient norm (mean, max) and the clip rate per interval (callbacks/gradient_norm.py)."""
    log_every_n_steps: Optional[int] = field(default=None, metadata={"ge": 1})
    """Logging interval in optimizer steps. null: trainer.log_every_n_steps."""
    per_layer_every_n_steps: int = field(default=0, metadata={"ge": 0})
    """Also log each block's gradient norm every this many steps (0: never)."""


@dataclass
class ThroughputConfig(Section):
    enabled: bool = False
    """Log tokens/s, samples/s, model FLOPs/s and MFU (callbacks/throughput.py)."""
    log_every_n_steps: Optional[int] = field(default=None, metadata={"ge": 1})
    """Logging interval in optimizer steps. null: trainer.log_every_n_steps."""
    peak_flops_per_s: Optional[float] = field(default=None, metadata={"gt": 0.0})
    """Peak FLOP/s of one device for MFU. null: a table of common GPUs, or a matmul measured at start on a CPU."""


@dataclass
class StabilityReportConfig(Section):
    enabled: bool = False
    """At the end of training write stability.json and print the stability report (callbacks/stability_report.py)."""


@dataclass
class MoEMonitorConfig(Section):
    enabled: bool = True
    """With model.moe: log each MoE layer's routing (moe/layer{i}/tokens_min, tokens_max, tokens_cv, max_share,
    dropped_fraction, aux_loss, z_loss, bias_norm) and record router collapse as an event (callbacks/moe_monitor.py).
    Does nothing for a dense model."""
    log_every_n_steps: Optional[int] = field(default=None, metadata={"ge": 1})
    """Logging interval in optimizer steps. null: trainer.log_every_n_steps."""
    collapse_share: float = field(default=0.5, metadata={"gt": 0.0, "le": 1.0})
    """Router collapse: one expert takes more than this share of a layer's assignments ..."""
    collapse_window: int = field(default=3, metadata={"ge": 1})
    """... at this many logged steps in a row; the event (label router_collapse) ends when the share falls back."""


@dataclass
class DownstreamEvalConfig(Section):
    enabled: bool = False
    """Run lm-evaluation-harness tasks during training (callbacks/downstream_eval.py; needs the `eval` extra) and log
    each task's scores as eval/<task>/<metric>, with their cost as eval/seconds and eval/tokens. Rank 0 evaluates,
    the other ranks wait (within strategy.timeout_seconds)."""
    tasks: List[str] = field(default_factory=list)
    """lm-eval task, group or tag names (or task YAML paths), e.g. [hellaswag, arc_easy]. An unknown name stops the
    run before its first step."""
    every_n_steps: Optional[int] = field(default=None, metadata={"ge": 1})
    """Run the tasks every this many optimizer steps, at that step's validation, and at the last step; a multiple of
    trainer.val_every_n_steps. null: at every validation."""
    limit: Optional[float] = field(default=None, metadata={"gt": 0.0})
    """Examples per task, the first ones (lm-eval's --limit); below 1, a fraction of each task. null: all."""
    max_tokens: Optional[int] = field(default=None, metadata={"ge": 1})
    """Token budget of one evaluation, shared equally by the tasks: each runs its first examples whose tokens through
    the model (context + continuation of every request; for generation, every recomputed window) fit in its share,
    at least one. Counted once, by tokenizing the requests before the first evaluation. null: no budget."""
    include_path: List[str] = field(default_factory=list)
    """Folders of your own task YAML files (lm-eval's --include_path); looked up before lm-eval's own tasks."""
    batch_size: int = field(default=8, metadata={"ge": 1})
    """Requests per forward pass."""
    num_fewshot: Optional[int] = field(default=None, metadata={"ge": 0})
    """Few-shot examples per prompt. null: each task's own default."""


@dataclass
class EmaConfig(Section):
    enabled: bool = False
    """Keep an exponential moving average of the weights in fp32 beside them (callbacks/ema.py; Polyak averaging as
    timm's ModelEmaV3 and OLMo-core keep it), updated after each optimizer step, evaluated at every validation on the
    same windows as the weights (val/ema_loss beside val/loss), saved in every checkpoint and sharded like the weights;
    `lit-pretrain export --weights ema` writes it. The loss spike's rewind restores the weights, not the average."""
    decay: float = field(default=0.999, metadata={"gt": 0.0, "lt": 1.0})
    """Per optimizer step: ema <- decay * ema + (1 - decay) * weights, so the average reaches back about 1 / (1 -
    decay) steps (0.999: 1,000)."""
    start_step: int = field(default=0, metadata={"ge": 0})
    """The optimizer step at which the average starts, as a copy of the weights then (0: the initial weights)."""
    every_n_steps: int = field(default=1, metadata={"ge": 1})
    """Update every this many steps after start_step, each update with decay ** every_n_steps, so the horizon in
    steps stays that of `decay` at a fraction of the update's cost."""


@dataclass
class CallbacksConfig(Section):
    extra: List[CallbackSpec] = field(default_factory=list)
    """User callbacks added to the Trainer, each `{class_path: "module:Class", init_args: {...}}`."""
    loss_spike: LossSpikeConfig = field(default_factory=LossSpikeConfig)
    """Loss-spike detection and recovery."""
    nan_guard: NanGuardConfig = field(default_factory=NanGuardConfig)
    """Non-finite loss/gradient guard."""
    gradient_norm: GradientNormConfig = field(default_factory=GradientNormConfig)
    """Gradient-norm monitor."""
    throughput: ThroughputConfig = field(default_factory=ThroughputConfig)
    """Throughput and MFU monitor."""
    stability_report: StabilityReportConfig = field(default_factory=StabilityReportConfig)
    """End-of-run stability report."""
    downstream_eval: DownstreamEvalConfig = field(default_factory=DownstreamEvalConfig)
    """lm-evaluation-harness tasks during training."""
    moe: MoEMonitorConfig = field(default_factory=MoEMonitorConfig)
    """Mixture-of-experts routing statistics and router-collapse events (model.moe only)."""
    ema: EmaConfig = field(default_factory=EmaConfig)
    """Exponential moving average of the weights."""


@dataclass
class RunConfig(Section):
    name: str = field(default="default", metadata={"pattern": SAFE_NAME, "rule": SAFE_NAME_RULE})
    """Run name: the run folder is root_dir/name. One folder name, never a path (lit_pretrain/paths.py)."""
    root_dir: str = "runs"
    """Folder that holds run folders."""
    seed: int = 1337
    """Seed of model initialization and of the training data order."""
    overwrite: bool = False
    """Allow starting again in an existing run folder: its previous contents are deleted first, but only when the
    project made it (it holds the `.lit-pretrain-run` marker, or a config.yaml of an older version's run)."""
    resume: Optional[str] = None
    """null: start afresh; auto: continue from the newest valid checkpoint of this run (afresh if it has none: the
    files of a start killed before its first checkpoint are moved to runs/<name>/attempts/<n>/, never deleted); or
    the path of a checkpoint file. See lit_pretrain/resume/."""
    resume_allow_changes: List[str] = field(default_factory=list)
    """Config keys a resume may change on purpose (e.g. [optim.lr_peak]); any other change is refused."""
    max_restarts: int = field(default=0, metadata={"ge": 0})
    """Restart a failed `lit-pretrain train` this many times, each from the newest verified checkpoint (run.resume
    =auto): a supervisor process launches the run, removes whatever processes of it are left after a failure and
    launches it again (lit_pretrain/launch/supervisor.py); after this many restarts a run that still fails stops
    with one line (its exit code and newest checkpoint each time). Not restarted: success, a preemption's
    checkpoint-and-stop (exit 0), a refused start (exit 2). Under torchrun use its --max-restarts, under SLURM the
    srun loop of `lit-pretrain launch slurm --max-restarts`: this key is refused there. 0: no restart."""
    keep_last_checkpoints: int = field(default=0, metadata={"ge": 0})
    """Keep the newest k step checkpoints (0: keep all); the newest valid one is never deleted."""
    init_from: Optional[str] = None
    """null: random initialization. Or start from these weights (continued pretraining): a transformers Llama folder
    (config.json, model.safetensors; `lit-pretrain export --to hf` writes one) or a .safetensors file under this GPT's
    own weight names (`lit-pretrain import --out`). Loaded after the model is built, before the first step; the
    model.* keys must be the weights' (`lit-pretrain import` sets them), and a tokenizer.json beside the weights must
    be the data's. Unused when resuming: the checkpoint holds the weights. See lit_pretrain/interop/hf.py."""


@dataclass
class CheckpointConfig(Section):
    format: Optional[str] = field(default=None, metadata={"choices": [None, "sharded", "single"]})
    """How a checkpoint is written. sharded: a folder checkpoints/step*/ in which every rank writes only the state it
    holds (torch.distributed.checkpoint), read back into any layout or one process (lit_pretrain/resume/sharded/);
    single: one file checkpoints/step*.ckpt gathered onto rank 0. null: sharded when the run has more than one
    process, single for one. Where and how often: trainer.checkpoint_every_n_steps, run.keep_last_checkpoints."""
    async_save: bool = False
    """Sharded format only: copy each rank's share, then write it in a background thread while training goes on;
    the next save, the end of training and a preemption wait for the write."""


@dataclass
class Config(Section):
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    callbacks: CallbacksConfig = field(default_factory=CallbacksConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


def _check_weight(key: str, weight: float) -> None:
    if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not 0 <= weight < float("inf"):
        raise ConfigError(f"{key}={weight!r}: a weight is a finite number >= 0 (shares are weights over their sum)")


def _check_meta(schema, name: str, value, key: str) -> None:
    """A field's `choices`/`ge`/`gt`/`le`/`lt` metadata, for list items (config.check_ranges covers sections)."""
    meta = next(f.metadata for f in fields(schema) if f.name == name)
    if value is None:
        return
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(f"{key}={value!r}: expected one of {[c for c in meta['choices'] if c is not None]}")
    for op, word, ok in (("ge", ">=", lambda b: value >= b), ("gt", ">", lambda b: value > b),
                         ("le", "<=", lambda b: value <= b), ("lt", "<", lambda b: value < b)):
        if op in meta and not ok(meta[op]):
            raise ConfigError(f"{key}={value!r}: expected a value {word} {meta[op]}")
