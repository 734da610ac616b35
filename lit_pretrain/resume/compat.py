"""What a checkpoint records about its run, and whether a resume may continue it under the current config.

A resume continues one experiment. Keys that only say how it is run (devices, strategy, threads, logging and
checkpoint intervals, workers) may change freely, as long as the global batch (tokens per optimizer step) is the
same. Keys that change the experiment (optimizer, schedule, seed, data, max_steps which shapes the schedule) are
refused unless listed in `run.resume_allow_changes` (the schedule then continues from the rate reached, or
schedule.stage declares a stage's own: optim/stages.py); keys that change the model's shape are refused always, since
the checkpoint's weights fit only their own shape; model.seq_len and model.rope_scaling hold no weight and may change
when listed (a context-extension stage). The tokenizer and the shard manifest are compared by hash; with data.sources
listed (a stage on a new mixture), each source the two runs share by name.
"""

import dataclasses
import functools
import hashlib
import json
from typing import Any, Dict, Iterable, List

from lit_pretrain.errors import ConfigError, DataError

# Keys that say how a run is executed, not what it computes.
FREE_PREFIXES = ("strategy.", "checkpoint.", "callbacks.extra", "trainer.profile.")
FREE_KEYS = {
    "run.resume", "run.resume_allow_changes", "run.overwrite", "run.keep_last_checkpoints", "run.root_dir",
    "trainer.devices", "trainer.num_nodes", "trainer.micro_batch_size", "trainer.num_threads", "trainer.accelerator",
    "trainer.progress_bar", "trainer.log_every_n_steps", "trainer.checkpoint_every_n_steps", "data.num_workers",
    "run.name", "data.prepared_dir", "trainer.loggers", "trainer.profile", "trainer.device_memory_gb",
    # Compiled and eager steps compute the same math (tests/parallel/test_compile.py); its default changed from false to
    # auto, so a run written before then must resume under the new default.
    "trainer.compile",
}


# Model keys that hold no weight: a context-extension stage (docs/resume.md) changes them on purpose, when
# run.resume_allow_changes lists them (model.rope_scaling: the section, or one of its keys).
STAGE_KEYS = ("model.seq_len", "model.rope_scaling")
# Model keys of the loss, not the weights: they may change when listed.
LOSS_KEYS = ("model.moe.aux_loss_scope",)
# Defaults that changed: key -> (the old default a checkpoint written before holds, the new one). Such a checkpoint
# resumes under the new default without listing it, and the console says so (session.continue_metrics); set the key
# to the old value to train on as it did. model.moe.aux_loss_scope: sequence is the same under every layout.
CHANGED_DEFAULTS = {"model.moe.aux_loss_scope": ("micro_batch", "sequence")}


def _listed(key: str, allow: Iterable[str]) -> bool:
    """key, or a section above it (model.rope_scaling for model.rope_scaling.factor), is in `allow`."""
    return any(key == a or key.startswith(a + ".") for a in allow)


# Keys a checkpoint written before their rename holds under the old name (config.RENAMED): trainer.val_batches
# counted batches per device, trainer.val_windows counts the windows in all. The validation set changes at such a
# resume once, and training not at all.
RENAMED = {"trainer.val_batches": "trainer.val_windows"}


def moved(flat: Dict[str, Any]) -> Dict[str, Any]:
    """A checkpoint's flattened config with the keys that moved since it was written (config.MOVED) under their new
    names, a section's keys too (model.float8.recipe -> trainer.float8.recipe)."""
    from lit_pretrain.config import MOVED

    out = {}
    for key, value in flat.items():
        old = next((o for o in MOVED if key == o or key.startswith(o + ".")), None)
        out[MOVED[old] + key[len(old):] if old is not None else key] = value
    return out


def flatten(tree: Any, prefix: str = "") -> Dict[str, Any]:
    if isinstance(tree, dict):
        out: Dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


@functools.lru_cache(maxsize=1)
def schema_defaults() -> Dict[str, Any]:
    """Every config key's default value, flattened like a checkpoint's config."""
    from lit_pretrain.schema import Config

    return flatten(dataclasses.asdict(Config()))


def manifest_sha256(manifest: Dict) -> str:
    """A hash of what the shards are: every shard's name, token count and sha256, and the tokenizer's."""
    parts = {"tokenizer": manifest["tokenizer"]["sha256"],
             "splits": {s: [(x["file"], x["tokens"], x["sha256"]) for x in info["shards"]]
                        for s, info in sorted(manifest["splits"].items())}}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def run_meta(config: Dict, manifest: Dict, tokens_per_step: int) -> Dict:
    """The run part of a checkpoint's metadata (plain JSON: it also goes into the checksum sidecar)."""
    return {"config": flatten(config), "config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True,
                                                                                  default=str).encode()).hexdigest(),
            "tokenizer_sha256": manifest["tokenizer"]["sha256"], "manifest_sha256": manifest_sha256(manifest),
            "tokens_per_step": tokens_per_step,
            **({"source_manifest_sha256": {name: manifest_sha256(m) for name, m in manifest["sources"].items()}}
               if manifest.get("sources") else {})}


def check_sources(saved: Dict, current: Dict, checkpoint: str) -> None:
    """A stage on a new mixture (data.sources in run.resume_allow_changes): each source both mixtures name must be
    the shards it was, so its position continues on the same windows; a source new to the stage starts at its first."""
    before, now = saved.get("source_manifest_sha256"), current.get("source_manifest_sha256")
    if before is None or now is None:
        raise DataError(f"the token shards (data.prepared_dir) differ from those checkpoint {checkpoint} was trained "
                        "on (manifest hash), and a new mixture needs both runs to train on data.sources: resume with "
                        "the run's data config, or start afresh")
    for i, name in enumerate(now):
        if name in before and before[name] != now[name]:
            raise DataError(f"data.sources[{i}] ({name}): its shards differ from those checkpoint {checkpoint} "
                            "trained on (manifest hash): point it at that source's prepared_dir, or give the new "
                            "data another source name")


def check_resume(saved: Dict, current: Dict, allow: Iterable[str], checkpoint: str, tokenizer_file: str) -> List[str]:
    """Raise a ConfigError/DataError naming the first refused difference; return the allowed changed keys."""
    allow = set(allow)
    before, now = moved(saved["config"]), flatten(current["config"])
    unknown = sorted(k for k in allow if k not in now and not any(n.startswith(k + ".") for n in now))
    if unknown:
        raise ConfigError(f"run.resume_allow_changes names {unknown[0]!r}, which is not a config key")
    if saved["tokenizer_sha256"] != current["tokenizer_sha256"]:
        raise DataError(f"tokenizer {tokenizer_file} differs from the one checkpoint {checkpoint} was trained with "
                        "(sha256): resume with the run's data.tokenizer_path and data.prepared_dir, or start afresh")
    if saved["manifest_sha256"] != current["manifest_sha256"] and _listed("data.sources", allow):
        check_sources(saved, current, checkpoint)
    elif saved["manifest_sha256"] != current["manifest_sha256"]:
        raise DataError(f"the token shards (data.prepared_dir) differ from those checkpoint {checkpoint} was trained "
                        "on (manifest hash): resume with the run's data.prepared_dir, or start afresh")
    if saved["tokens_per_step"] != current["tokens_per_step"] and "trainer.tokens_per_step" not in allow:
        raise ConfigError(f"trainer.tokens_per_step: the checkpoint trained with {saved['tokens_per_step']} tokens "
                          f"per optimizer step, this config gives {current['tokens_per_step']} (micro_batch_size × "
                          "seq_len × data-parallel degree × accumulation; null: micro_batch_size × seq_len): set "
                          "trainer.tokens_per_step to the checkpoint's")
    changed = []
    for key in sorted(set(before) | set(now)):
        if key in FREE_KEYS or key.startswith(FREE_PREFIXES) or before.get(key) == now.get(key):
            continue
        if key in RENAMED and key not in now or key in RENAMED.values() and key not in before:
            continue  # a checkpoint written before the rename: the new key takes over from here
        if key not in before and now.get(key) == schema_defaults().get(key, object()):
            continue  # a key the checkpoint predates (e.g. model.moe), at its default: what that run computed
        if key in CHANGED_DEFAULTS and (before.get(key), now.get(key)) == CHANGED_DEFAULTS[key]:
            changed.append(key)  # written under the old default, resumed under the new one
            continue
        if key.startswith("model.") and not _listed(key, LOSS_KEYS) and not (_listed(key, STAGE_KEYS)
                                                                              and _listed(key, allow)):
            raise ConfigError(f"{key} is {now.get(key)!r} here but {before.get(key)!r} in checkpoint {checkpoint}: "
                              "the model's shape cannot change on resume; set it back, or start a new run")
        if not _listed(key, allow):
            # schedule.stage: a section made whole by a stage; name it, not one of its keys.
            name = "schedule.stage" if key.startswith("schedule.stage.") else key
            raise ConfigError(f"{key} is {now.get(key)!r} here but {before.get(key)!r} in checkpoint {checkpoint}: "
                              f"set it back, or allow the change with run.resume_allow_changes=[{name}]")
        changed.append(key)
    return changed
