"""`lit-pretrain checkpoint consolidate`: a sharded checkpoint folder as one file, in one process without a process
group (`inspect`: resume/sharded/inspect.py).

consolidate writes the dict a one-process run would have written (resume/verified.py's one-file format: the file and
its sha256 sidecar), or a `.safetensors` of the weights (the file `lit-pretrain import --out` writes, for
run.init_from). Memory stays near the largest tensor, whatever the checkpoint's size: the file's pickle is written
first with a placeholder per tensor that pickles exactly as torch.save pickles a tensor (its storage record, by
key), then each record is read from the shards and written, one tensor at a time (torch.save's own zip writer, so
the file is an ordinary torch.save file that `torch.load(weights_only=True)` reads).
"""

import ctypes
import dataclasses
import io
import json
import pickle
import struct
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict

import torch
from torch.distributed.checkpoint import metadata as dcp_meta

from lit_pretrain.atomic import HashingWriter, atomic_open, atomic_write_bytes
from lit_pretrain.errors import DataError
from lit_pretrain.internals import (
    rebuild_tensor,
    storage_alignment,
    typed_storage_class,
    typed_storage_record,
    untyped_storage_dtypes,
    untyped_storage_identity,
)
from lit_pretrain.resume.sharded import format as sf
from lit_pretrain.resume.verified import META_KEY, sidecar_path, zip_writer

MODEL, OPTIM = "model.", "optim."
try:
    _LIBC = ctypes.CDLL("libc.so.6")
    _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
except (OSError, AttributeError):  # not glibc
    _LIBC = None
PARAM_NAMES = "param_names"  # trainer_state.pt: per optimizer group, single-process parameter names in its order


def _release() -> None:
    """Hand freed tensor buffers back to the OS (glibc's malloc_trim; elsewhere nothing). glibc raises its mmap
    threshold after a large buffer is freed, so the next ones come from the heap and stay in the process once
    freed: measured here, consolidating 48 tensors of 4 MB peaked 80 MB above the start without this, 8 with it."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _read(reader: sf.VerifiedFileSystemReader, key: str, saved) -> Any:
    if isinstance(saved, dcp_meta.TensorStorageMetadata):
        return reader.read_tensor(key)
    state = {key: None}  # a non-tensor item: through DCP (weights-only, see format.py)
    sf.dcp_load(state, reader)
    return state[key]


class _PendingStorage:
    """The storage record of a tensor not read yet (see _Pending)."""

    def __init__(self, key: str, saved: dcp_meta.TensorStorageMetadata):
        self.key, self.saved = key, saved
        self.dtype, self.shape = saved.properties.dtype, tuple(saved.size)
        self.v3 = self.dtype in untyped_storage_dtypes()  # dtypes torch.save writes as untyped storages
        self.numel = torch.Size(self.shape).numel()
        if self.v3:
            self.storage_type, self.numel = torch.UntypedStorage, self.numel * self.dtype.itemsize
        else:
            self.storage_type = typed_storage_class(self.dtype)


class _Pending:
    """A tensor of the shards, pickled as torch.save pickles a contiguous CPU tensor (torch/_tensor.py
    __reduce_ex__: _rebuild_tensor_v2 over a typed storage, v3 for the newer dtypes) without reading it."""

    def __init__(self, key: str, saved: dcp_meta.TensorStorageMetadata):
        self.storage = _PendingStorage(key, saved)

    def __reduce_ex__(self, protocol: int):
        s = self.storage
        args = (s, 0, s.shape, torch.empty(s.shape, device="meta").stride(), False, OrderedDict())
        return (rebuild_tensor(untyped=True), args + (s.dtype,)) if s.v3 else (rebuild_tensor(untyped=False), args)


class _Pickler(pickle.Pickler):
    """torch.save's persistent ids (torch/serialization.py _save), for real storages and pending ones alike."""

    def __init__(self, buf):
        super().__init__(buf, protocol=2)  # torch.save's DEFAULT_PROTOCOL
        self.storages: Dict[str, Any] = {}  # record key -> _PendingStorage or a real UntypedStorage
        self._keys: Dict[int, str] = {}

    def _key(self, ident: int, storage: Any) -> str:
        if ident not in self._keys:
            self._keys[ident] = str(len(self.storages))
            self.storages[self._keys[ident]] = storage
        return self._keys[ident]

    def persistent_id(self, obj: Any):
        if isinstance(obj, _PendingStorage):
            return ("storage", obj.storage_type, self._key(id(obj), obj), "cpu", obj.numel)
        if isinstance(obj, torch.storage.TypedStorage):
            untyped, identity, storage_class, size = typed_storage_record(obj)
            return ("storage", storage_class, self._key(identity, untyped), "cpu", size)
        if torch.is_storage(obj):
            return ("storage", torch.UntypedStorage, self._key(untyped_storage_identity(obj), obj), "cpu", obj.nbytes())
        return None


def _trainer_state(folder: Path) -> Dict[str, Any]:
    path = folder / sf.TRAINER_STATE
    if not path.is_file():
        raise DataError(f"checkpoint {folder} has no {sf.TRAINER_STATE}: not a training checkpoint of this project")
    try:  # listed in the manifest and verified with the folder
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001
        raise DataError(f"checkpoint file {path} cannot be read as weights-only data ({err})") from None


def _optimizer_state(folder: Path, reader, saved: Dict, trainer: Dict) -> Dict[str, Any]:
    """The optimizer state by parameter name, as every one-file checkpoint holds it (optim/named_state.py), its
    tensors pending (read as the file is written)."""
    from lit_pretrain.resume.sharded.save import named_optimizer_state

    flat = {key[len(OPTIM):]: _Pending(key, md) if isinstance(md, dcp_meta.TensorStorageMetadata)
            else _read(reader, key, md) for key, md in saved.items() if key.startswith(OPTIM)}
    return named_optimizer_state(trainer, flat, folder)


def _write_checkpoint(folder: Path, reader, saved: Dict, trainer: Dict, out: Path) -> None:
    ckpt = {k: v for k, v in trainer.items() if k != PARAM_NAMES}
    ckpt["state_dict"] = {**(trainer.get("state_dict") or {}),  # the module's other entries, if it has any
                          **{k: _Pending(k, md) if isinstance(md, dcp_meta.TensorStorageMetadata) else
                             _read(reader, k, md) for k, md in saved.items() if k.startswith(MODEL)}}
    head, embedding = f"{MODEL}lm_head.weight", f"{MODEL}tok_embeddings.weight"
    if head in ckpt["state_dict"] and embedding in ckpt["state_dict"] and _model_fields(folder, trainer, {}).get(
            "tie_embeddings"):  # one matrix under two names, stored once, as torch.save stores a tied GPT
        ckpt["state_dict"][head] = ckpt["state_dict"][embedding]
    from lit_pretrain.resume.sharded.save import EMA, EMA_KEY

    ema = {k[len(EMA):]: _Pending(k, md) for k, md in saved.items()
           if k.startswith(EMA) and isinstance(md, dcp_meta.TensorStorageMetadata)}
    if ema:  # the weights' EMA (callbacks/ema.py), whole by parameter name as a one-file checkpoint holds it
        ckpt[EMA_KEY] = ema
    if any(k.startswith(OPTIM) for k in saved):
        states = trainer.get("optimizer_states")
        if not (isinstance(states, list) and len(states) == 1 and isinstance(states[0], dict)):
            raise DataError(f"checkpoint file {folder / sf.TRAINER_STATE} holds no single optimizer state's groups")
        ckpt["optimizer_states"] = [{**states[0], **_optimizer_state(folder, reader, saved, trainer)}]
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    pickler.dump(ckpt)
    data, alignment = buf.getvalue(), str(storage_alignment())
    with atomic_open(out, sync_folder=False) as f:  # the sidecar's folder fsync follows (resume/verified.py)
        writer = HashingWriter(f)
        zip_file = zip_writer(writer)  # the records torch.save writes (verified.py torch_save), without CRC-32s
        for name, value in (("data.pkl", data), (".format_version", "1"), (".storage_alignment", alignment),
                            ("byteorder", sys.byteorder)):
            zip_file.write_record(name, value, len(value))
        for key, source in pickler.storages.items():
            storage = _read(reader, source.key, source.saved).untyped_storage() \
                if isinstance(source, _PendingStorage) else source
            zip_file.write_record(f"data/{key}", storage, storage.nbytes())
            del storage  # one tensor in memory at a time
            _release()
        zip_file.write_end_of_file()
    side = {"file": out.name, **writer.record(), "meta": ckpt.get(META_KEY, {})}  # save_atomic's sidecar
    atomic_write_bytes(sidecar_path(out), (json.dumps(side, indent=1) + "\n").encode())


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


def _model_fields(folder: Path, trainer: Dict, default: Any = None) -> Dict[str, Any]:
    """The run's GPTConfig fields, from trainer_state.pt as load_gpt finds them; `default` (when given) if absent."""
    from lit_pretrain.model.config import GPTConfig
    from lit_pretrain.resume.weights import _section

    try:
        return dataclasses.asdict(_section(trainer, folder / sf.TRAINER_STATE, "model", GPTConfig))
    except DataError:
        if default is None:
            raise
        return default


def _write_safetensors(folder: Path, reader, saved: Dict, trainer: Dict, out: Path) -> None:
    """The weights under GPT names with the model fields and tokenizer sha256 (hf.py write_weights' metadata),
    streamed: safetensors is an 8-byte header length, a JSON header of offsets, then the tensors' bytes."""
    from lit_pretrain.resume.weights import META_MODEL, META_TOKENIZER

    fields = _model_fields(folder, trainer)
    keys = [k for k, md in saved.items() if k.startswith(MODEL) and isinstance(md, dcp_meta.TensorStorageMetadata)
            and not (fields.get("tie_embeddings") and k == f"{MODEL}lm_head.weight")]  # one copy of a tied matrix
    header: Dict[str, Any] = {"__metadata__": {"format": "pt", META_MODEL: json.dumps(fields), META_TOKENIZER:
                                               (trainer.get(META_KEY) or {}).get("tokenizer_sha256") or ""}}
    offset = 0
    for key in keys:
        md = saved[key]
        if md.properties.dtype not in SAFETENSORS_DTYPES:
            raise DataError(f"checkpoint {folder}: {key} is {md.properties.dtype}, which safetensors cannot hold")
        size = torch.Size(md.size).numel() * md.properties.dtype.itemsize
        header[key[len(MODEL):]] = {"dtype": SAFETENSORS_DTYPES[md.properties.dtype], "shape": list(md.size),
                                    "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with atomic_open(out) as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for key in keys:
            f.write(_read(reader, key, saved[key]).reshape(-1).view(torch.uint8).numpy().data)
            _release()


def consolidate(folder: str | Path, out: str | Path) -> Path:
    """One single-process checkpoint file OUT (`.safetensors`: the weights only) from a sharded checkpoint folder,
    verified first; OUT must not exist."""
    folder, out = Path(folder), Path(out)
    if folder.is_file():
        raise DataError(f"checkpoint {folder} is one file already: consolidate reads a sharded checkpoint folder")
    if out.exists() or out.is_symlink():
        raise DataError(f"{out} already exists: give a new file name (nothing was overwritten)")
    reader = sf.VerifiedFileSystemReader(folder)
    saved = reader.read_metadata().state_dict_metadata
    trainer = _trainer_state(folder)
    (_write_safetensors if out.suffix == ".safetensors" else _write_checkpoint)(folder, reader, saved, trainer, out)
    return out
