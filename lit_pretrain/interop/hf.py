"""Hand a run's weights to the Hugging Face ecosystem, and start a run from them again.

`lit-pretrain export RUN_OR_CKPT --to hf OUT` writes a transformers folder: config.json (LlamaForCausalLM),
model.safetensors, and the run's tokenizer (tokenizer.json, tokenizer_config.json naming the end-of-document token as
eos and bos). The exported tokenizer puts the end-of-document token first, as `lit-pretrain generate` does and as
the shards have it before every document, the way Llama 3's tokenizer adds <|begin_of_text|>: AutoTokenizer's ids
for a text are the ones our model continues.
`lit-pretrain import HF_FOLDER RUN_FILE [overrides]` trains a run whose model.* keys come from config.json and whose
weights start from the folder's (`run.init_from=HF_FOLDER`); `--out FILE` instead writes the weights under our own
names, for `run.init_from=FILE`.

Why `run.init_from` names the folder itself rather than a converted copy: the run's config.yaml then records where
its weights came from, and there is no intermediate file to keep beside it. Converting is only renaming (llama.py),
so it is done on load. Neither direction needs transformers: only safetensors (no pickle: a weights file can't
run code when read). Nothing is ever written into an existing, non-empty folder.
"""

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from lit_pretrain import config as config_lib
from lit_pretrain.data.shards import pretokenized_run, run_tokenizer_entry, tokenizer_folder
from lit_pretrain.data.tokenizer import EOD, eod_id, load_tokenizer, tokenizer_sha256
from lit_pretrain.errors import ConfigError, DataError
from lit_pretrain.interop.llama import (
    FUNCTION_FIELDS,
    VARIANT_DEFAULTS,
    check_exportable,
    from_llama_config,
    from_llama_names,
    function_fields,
    to_export_names,
    to_llama_config,
)
from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT
from lit_pretrain.paths import safe_rmtree
from lit_pretrain.resume.weights import META_MODEL, META_TOKENIZER, load_gpt

CONFIG, WEIGHTS, INDEX, TOKENIZER = "config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json"
STAGING_PREFIX = ".lit-pretrain-export-"


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise DataError("reading or writing Hugging Face weights needs the safetensors package: "
                        "pip install 'lit-pretrain[hf]'") from None
    return safetensors.torch


# ---------------------------------------------------------------------------------------------------------- export

def resolve_source(source: str | Path) -> Tuple[Path, str]:
    """(run folder, checkpoint name) of RUN_OR_CKPT: a run folder (its last.ckpt) or a checkpoint in one."""
    path = Path(source)
    if path.is_dir():
        return path, "last.ckpt"
    if path.is_file() and path.parent.name == "checkpoints" and (path.parent.parent / "config.yaml").is_file():
        return path.parent.parent, path.name
    if path.is_file():
        raise DataError(f"{path} is not inside a run's checkpoints/ folder: export reads the model's shape and "
                        "tokenizer from the run's config.yaml; give runs/<name> or runs/<name>/checkpoints/<file>.ckpt")
    raise DataError(f"{path} does not exist: give a run folder (runs/<name>) or one of its checkpoints")


def run_tokenizer(run_dir: Path) -> Path:
    """The tokenizer.json a run trained with: its data.prepared_dir's, checked against the manifest's sha256."""
    data = config_lib.load(run_dir / "config.yaml", check_inputs=False).data
    prepared = tokenizer_folder(data)
    if not pretokenized_run(data) and not prepared.is_dir():
        raise DataError(f"data.prepared_dir {prepared} in {run_dir / 'config.yaml'} does not exist: export copies the "
                        "run's tokenizer from there; run from the folder the run was trained in")
    folder, tok = run_tokenizer_entry(data)  # a pretokenized corpus: data.tokenizer_path itself
    path = folder / tok["file"]
    if not path.is_file() or tokenizer_sha256(path) != tok["sha256"]:
        raise DataError(f"{path} is missing or differs from the one {prepared / 'manifest.json'} records (sha256)")
    return path


def export_run(source: str | Path, out: str | Path, weights: str = "raw") -> Path:
    """`lit-pretrain export RUN_OR_CKPT --to hf OUT [--weights raw|ema]` (ema: the weights' EMA, callbacks.ema)."""
    run_dir, checkpoint = resolve_source(source)
    tokenizer = run_tokenizer(run_dir)
    out = check_target(out)  # before reading the checkpoint: refuse a full folder at once
    return export_gpt(load_gpt(run_dir, checkpoint, weights=weights), tokenizer, out)


def check_target(out: str | Path) -> Path:
    out = Path(out)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise DataError(f"{out} exists and is not a folder: export into a new or empty folder")
    if out.is_dir() and any(out.iterdir()):
        raise DataError(f"{out} exists and is not empty: export into a new or empty folder (nothing was written)")
    return out


def export_gpt(model: GPT, tokenizer_file: str | Path, out: str | Path) -> Path:
    """Write `model` and its tokenizer as a transformers LlamaForCausalLM folder (Qwen3ForCausalLM with
    model.qk_norm, OlmoeForCausalLM with model.moe: lit_pretrain/interop/olmoe.py, DeepseekV3ForCausalLM with
    model.attention=mla: interop/deepseek.py, Qwen3NextForCausalLM with model.attention_gate:
    lit_pretrain/interop/qwen3_next.py) at `out` (new or empty)."""
    check_exportable(model.cfg)  # before anything is written
    st = _safetensors()
    cfg, out = model.cfg, check_target(out)
    # model.mtp_depth's modules are dropped: trained only (lit_pretrain/model/mtp.py), the main head's logits need
    # none of them, and transformers' Llama has no place for them (our checkpoints keep them)
    tensors = to_export_names({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()
                               if not k.startswith("mtp.")}, cfg)
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
    if len(dtypes) != 1:
        raise DataError(f"the model's weights have several dtypes {dtypes}: a Llama config.json names one")
    tokenizer = load_tokenizer(tokenizer_file)
    if tokenizer.get_vocab_size() > cfg.vocab_size:
        raise DataError(f"tokenizer {tokenizer_file} has {tokenizer.get_vocab_size()} tokens, more than the model's "
                        f"model.vocab_size={cfg.vocab_size}: it is not this model's tokenizer")
    eod = eod_id(tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written beside OUT and renamed into place: a reader never sees half a folder, and rename(2) replaces an empty
    # folder but fails on a non-empty one, so a folder filled meanwhile is never overwritten.
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out.parent))
    try:
        st.save_file(tensors, staging / WEIGHTS, metadata={"format": "pt"})
        _write_json(staging / CONFIG, to_llama_config(cfg, eod, dtypes[0]))
        _write_json(staging / "generation_config.json", {"bos_token_id": eod, "eos_token_id": eod})
        (staging / TOKENIZER).write_text(json.dumps(exported_tokenizer(tokenizer_file, eod), indent=2,
                                                    ensure_ascii=False), encoding="utf-8")
        # add_bos_token: transformers 5 rebuilds the post-processor from it (the same template); 4.x reads the file's.
        _write_json(staging / "tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOD, "bos_token": EOD, "add_bos_token": True,
            "add_eos_token": False, "model_max_length": cfg.seq_len, "clean_up_tokenization_spaces": False})
        _write_json(staging / "special_tokens_map.json", {"eos_token": EOD, "bos_token": EOD})
        try:
            os.rename(staging, out)
        except OSError as err:
            raise DataError(f"{out} could not be written ({err.strerror}): export into a new or empty folder") from None
    finally:
        _remove_staging(staging, out.parent)
    return out


def exported_tokenizer(tokenizer_file: str | Path, eod: int) -> Dict[str, Any]:
    """The run's tokenizer.json with a post-processor that puts token `eod` before a text's ids (and before each of
    a pair's), as generate.prompt_ids does. It replaces any post-processor the file had: our trained tokenizers have
    none; a Llama 3 one adds <|begin_of_text|>, which the data (data.bos_token) may not have put before documents."""
    from tokenizers import Tokenizer, models, processors

    data = json.loads(Path(tokenizer_file).read_text(encoding="utf-8"))
    token = load_tokenizer(tokenizer_file, eos_token=None).id_to_token(eod)
    carrier = Tokenizer(models.BPE())
    carrier.post_processor = processors.TemplateProcessing(single=f"{token} $A", pair=f"{token} $A {token} $B:1",
                                                           special_tokens=[(token, eod)])
    data["post_processor"] = json.loads(carrier.to_str())["post_processor"]
    return data


def vocabulary_sha256(tokenizer_file: str | Path) -> str:
    """sha256 of a tokenizer.json without its post-processor: what the ids mean, which an export leaves as it was
    (`exported_tokenizer` only adds the token put first), so an exported folder imports with the run's data."""
    data = json.loads(Path(tokenizer_file).read_text(encoding="utf-8"))
    data.pop("post_processor", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def _write_json(path: Path, data: Dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _remove_staging(staging: Path, parent: Path) -> None:
    # Only the folder this export made (mkdtemp's prefix, inside OUT's parent, no link); gone already once renamed.
    if staging.exists():
        safe_rmtree(staging, parent, lambda folder: folder.name.startswith(STAGING_PREFIX), "export staging folder")


# ---------------------------------------------------------------------------------------------------------- import

def read_hf_config(folder: str | Path) -> Dict[str, Any]:
    """GPTConfig fields (and seq_len) of a transformers folder's config.json, or a DataError naming the problem."""
    path = Path(folder) / CONFIG
    if not path.is_file():
        raise DataError(f"{path} does not exist: give a transformers model folder (config.json, model.safetensors)")
    try:
        hf = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise DataError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(hf, dict):
        raise DataError(f"{path} must hold a JSON object")
    return from_llama_config(hf, str(path))


def _read_tensors(path: Path) -> Dict[str, torch.Tensor]:
    st = _safetensors()
    try:
        return st.load_file(path)
    except Exception as err:  # OSError, or safetensors' own SafetensorError (which derives from Exception only)
        raise DataError(f"{path} cannot be read as safetensors ({err})") from None


def read_hf_weights(folder: str | Path, tied: bool) -> Dict[str, torch.Tensor]:
    """The folder's weights under our names: model.safetensors, or the shards its index names."""
    folder = Path(folder)
    if (folder / WEIGHTS).is_file():
        tensors = _read_tensors(folder / WEIGHTS)
    elif (folder / INDEX).is_file():
        try:
            files = sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise DataError(f"{folder / INDEX} has no weight_map of file names ({err})") from None
        tensors = {}
        for name in files:
            if not isinstance(name, str) or Path(name).name != name:  # a plain name in this folder, never a path
                raise DataError(f"{folder / INDEX} names {name!r}, not a file name in {folder}")
            tensors.update(_read_tensors(folder / name))
    else:
        raise DataError(f"{folder} has no {WEIGHTS} (nor {INDEX}): import reads safetensors only, never pickled "
                        "pytorch_model.bin (unpickling runs code); save the model with safe_serialization=True")
    return from_llama_names(tensors, tied, str(folder))[0]


def read_init(path: str | Path) -> Tuple[Optional[Dict[str, Any]], Dict[str, torch.Tensor], Optional[str]]:
    """(model fields or None, weights under our names, tokenizer sha256 or None) of `run.init_from`."""
    path = Path(path)
    if path.is_dir():
        fields = read_hf_config(path)
        tokenizer = path / TOKENIZER
        return fields, read_hf_weights(path, fields["tie_embeddings"]), \
            vocabulary_sha256(tokenizer) if tokenizer.is_file() else None
    if not path.is_file():
        raise DataError(f"run.init_from {path} does not exist: give a transformers folder or a .safetensors file")
    _safetensors()
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as err:  # SafetensorError derives from Exception only
        raise DataError(f"run.init_from {path} cannot be read as safetensors ({err})") from None
    try:
        fields = json.loads(meta[META_MODEL]) if META_MODEL in meta else None
    except ValueError:
        fields = {}
    if isinstance(fields, dict):  # written before the variant keys existed: the values they stood for
        fields = {**VARIANT_DEFAULTS, **fields}
    if fields is not None and (not isinstance(fields, dict) or set(FUNCTION_FIELDS) - set(fields)):
        raise DataError(f"run.init_from {path}: its {META_MODEL} metadata is not the model fields "
                        "`lit-pretrain import --out` writes")
    tensors = _read_tensors(path)
    if any(name.startswith("model.layers.") for name in tensors):
        raise DataError(f"run.init_from {path} holds transformers' weight names: give its folder (with config.json) "
                        "as run.init_from, or convert it with `lit-pretrain import FOLDER --out FILE`")
    return fields, tensors, meta.get(META_TOKENIZER) or None


def load_weights(model: GPT, state: Dict[str, torch.Tensor], source: str) -> GPT:
    """Copy `state` (our names; a tied head may be left out) into `model`, naming any key or shape that differs."""
    state = dict(state)
    if model.cfg.tie_embeddings and "tok_embeddings.weight" in state:
        state.setdefault("lm_head.weight", state["tok_embeddings.weight"])
    expected = model.state_dict()
    for name in sorted(set(expected) | set(state)):
        if name not in state:
            raise DataError(f"{source} has no weight {name!r} (model.tie_embeddings={model.cfg.tie_embeddings})")
        if name not in expected:
            raise DataError(f"{source} has a weight {name!r} this model does not")
        if state[name].shape != expected[name].shape:
            raise ConfigError(f"{source}: weight {name!r} has shape {tuple(state[name].shape)}, the model's is "
                              f"{tuple(expected[name].shape)}: set the model.* keys to the weights' "
                              "(lit-pretrain import does)")
    with torch.no_grad():
        model.load_state_dict(state, strict=True)
    return model


def load_init(model: GPT, path: str | Path, tokenizer_file: Optional[str | Path] = None) -> GPT:
    """`run.init_from`: the model starts from these weights, which must compute with the model's own settings and
    mean tokens of the tokenizer the data is tokenized with."""
    fields, state, tokenizer_sha = read_init(path)
    ours = function_fields(model.cfg)
    for key in FUNCTION_FIELDS:
        if fields is not None and fields[key] != ours[key]:
            raise ConfigError(f"model.{key}={ours[key]!r} but run.init_from {path} has {fields[key]!r}: set "
                              f"model.{key}={fields[key]!r} (lit-pretrain import sets every model key from the folder)")
    # A folder's (and `import --out`'s) sha256 is of the vocabulary (vocabulary_sha256); a consolidated checkpoint's
    # is of the data's tokenizer.json file.
    if tokenizer_sha and tokenizer_file and tokenizer_sha not in (tokenizer_sha256(tokenizer_file),
                                                                  vocabulary_sha256(tokenizer_file)):
        raise DataError(f"the tokenizer of run.init_from {path} differs from the data's {tokenizer_file} (sha256): the "
                        "weights' token ids would mean other tokens; tokenize the data with it: "
                        f"data.tokenizer_path=<its tokenizer.json> and a new data.prepared_dir")
    return load_weights(model, state, f"run.init_from {path}")


def import_overrides(folder: str | Path) -> list:
    """The overrides `lit-pretrain import` puts between the run file and the user's: model.* and run.init_from."""
    fields = read_hf_config(folder)
    return [f"model.{k}={json.dumps(v)}" for k, v in fields.items()] + [f"run.init_from={Path(folder).resolve()}"]


def write_weights(folder: str | Path, out: str | Path) -> Path:
    """`lit-pretrain import HF_FOLDER --out FILE`: the folder's weights under our names, in a new safetensors file."""
    st, out = _safetensors(), Path(out)
    if out.exists() or out.is_symlink():
        raise DataError(f"{out} already exists: give a new file name (nothing was overwritten)")
    fields = read_hf_config(folder)
    model = load_weights(GPT(GPTConfig(**fields)), read_hf_weights(folder, fields["tie_embeddings"]), str(folder))
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()
               if not (fields["tie_embeddings"] and k == "lm_head.weight")}  # one copy of a tied matrix
    tokenizer = Path(folder) / TOKENIZER
    meta = {"format": "pt", META_MODEL: json.dumps(fields),
            META_TOKENIZER: vocabulary_sha256(tokenizer) if tokenizer.is_file() else ""}
    out.parent.mkdir(parents=True, exist_ok=True)
    # A staging name mkstemp made for this call (never a file of the user's), linked to OUT, then removed.
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    staging = Path(name)
    try:
        st.save_file(tensors, staging, metadata=meta)
        os.link(staging, out)  # fails if OUT appeared meanwhile: never overwrite
    except FileExistsError:
        raise DataError(f"{out} already exists: give a new file name (nothing was overwritten)") from None
    finally:
        staging.unlink(missing_ok=True)
    return out
