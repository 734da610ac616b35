"""Reading a sharded checkpoint folder (the format: resume/sharded/manifest.py, and the contract in the README's
resume section): verified first, then DCP's `.metadata`, a pickle, through a restricted unpickler that builds only
the classes DCP's Metadata is made of (torch 2.13's FileSystemReader calls plain `pickle.load`; DCP has no safe path
for it), and non-tensor items only with `torch.load(weights_only=True)` (DCP's default planner unpickles them with
weights_only=False). FileSystemReader reads tensor items with weights_only=True already. `load_sharded_full` gives
the full tensors in one process, without a process group; resume/sharded/tools.py consolidates and inspects.
"""

import io
import pickle
import warnings
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_meta
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType

from lit_pretrain.errors import DataError
from lit_pretrain.resume.sharded.manifest import (  # noqa: F401 (re-exported: the format's one import place)
    FIX,
    FORMAT,
    MANIFEST,
    METADATA,
    STEP_FOLDER,
    TRAINER_STATE,
    file_record,
    is_sharded,
    read_manifest,
    verify_sharded,
    write_manifest,
)
from lit_pretrain.resume.verified import _refuse

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# What torch 2.13's Metadata pickles to (read off metadata.py and filesystem.py and unpickling real saves, 1 to 4
# ranks): its dataclasses and enum, FileSystemWriter's per-item _StorageInfo, torch.Size, dtypes (checked below),
# layouts (torch.serialization._get_layout, a table lookup by name) and the PosixPath of StorageMeta.checkpoint_id.
ALLOWED_CLASSES = frozenset({
    *((_DCP_METADATA, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                   "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
})


class _Refused(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)  # plain names only
        if (module, name) in ALLOWED_CLASSES or dtype:
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


def _well_formed(metadata: Any, files: Mapping[str, Dict]) -> bool:
    """A Metadata whose every storage entry lies inside a .distcp file the manifest lists (no path elsewhere, no
    bytes past its end, no stream transforms: this project writes none)."""
    if not (isinstance(metadata, dcp_meta.Metadata) and isinstance(metadata.state_dict_metadata, dict)
            and isinstance(metadata.storage_data, dict)):
        return False
    kinds = (dcp_meta.TensorStorageMetadata, dcp_meta.BytesStorageMetadata)
    if not all(isinstance(k, str) and isinstance(v, kinds) for k, v in metadata.state_dict_metadata.items()):
        return False
    for index, info in metadata.storage_data.items():
        if not (isinstance(index, dcp_meta.MetadataIndex) and isinstance(info, _StorageInfo)):
            return False
        name, offset, length = info.relative_path, info.offset, info.length
        if not (isinstance(name, str) and name.endswith(".distcp") and name in files and isinstance(offset, int)
                and isinstance(length, int) and 0 <= offset and 0 <= length
                and offset + length <= files[name]["bytes"] and not info.transform_descriptors):
            return False
    return True


def read_metadata_file(path: str | Path, files: Mapping[str, Dict]) -> dcp_meta.Metadata:
    """DCP's Metadata from `path`, through the restricted unpickler, its storage entries checked against the
    manifest's `files` (each names a listed .distcp, within its size). Call after verify_sharded."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Refused as err:
        raise _refuse(path, f"its pickle names {err}", f"is refused: its pickle names {err}, which DCP metadata "
                      f"never holds (loading it could run code); {FIX}") from None
    except Exception as err:  # noqa: BLE001 (a malformed pickle raises about anything)
        raise _refuse(path, "unreadable DCP metadata", f"cannot be read as DCP metadata ({err}); {FIX}") from None
    if not _well_formed(metadata, files):
        raise _refuse(path, "malformed DCP metadata", f"is not DCP metadata of this folder's files (an entry names "
                      f"a file outside the manifest, or bytes past its end); {FIX}")
    return metadata


class _WeightsOnlyBytes:
    """The planner, except that a non-tensor item is unpickled with weights_only=True first: DCP's default
    planner calls torch.load(weights_only=False) on it, which would run any code the bytes name."""

    def __init__(self, planner):
        self._planner = planner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item, value) -> None:
        try:
            torch.load(value, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001
            raise DataError(f"checkpoint item {read_item.dest_index.fqn} is not weights-only data ({err})") from None
        value.seek(0)
        self._planner.load_bytes(read_item, value)  # the same bytes: only plain data and tensors, checked above


class VerifiedFileSystemReader(FileSystemReader):
    """FileSystemReader of a folder verify_sharded has passed (run here, on construction, and again on a reset to
    another folder), whose `.metadata` goes through the restricted unpickler."""

    def __init__(self, path: str | Path, check_sha256: bool = True):
        self.manifest = verify_sharded(path, check_sha256)
        self._metadata: Dict[str, dcp_meta.Metadata] = {}
        super().__init__(path)

    def reset(self, checkpoint_id: Optional[str | Path] = None) -> None:
        if checkpoint_id is not None and Path(checkpoint_id).resolve() != Path(self.path).resolve():
            self.manifest, self._metadata = verify_sharded(checkpoint_id), {}
        super().reset(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_meta.Metadata:
        rank = kwargs.get("rank")
        name = METADATA if rank is None else f"__{rank}{METADATA}"
        if name not in self.manifest["files"]:
            raise _refuse(Path(self.path) / name, f"not listed in {MANIFEST}", f"is not listed in {MANIFEST}; {FIX}")
        if name not in self._metadata:  # verified files do not change under us: parse once per reader
            self._metadata[name] = read_metadata_file(Path(self.path) / name, self.manifest["files"])
        metadata = self._metadata[name]
        metadata.storage_meta = metadata.storage_meta or dcp_meta.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_tensor(self, key: str) -> torch.Tensor:
        """The full tensor saved under `key`, its chunks read straight from the files (FileSystemWriter's layout:
        each chunk a torch.save'd tensor at its offset, bounds checked by read_metadata_file) with weights_only=True.
        No planner: nothing but the result outlives the call (consolidate reads one tensor at a time)."""
        metadata = self.read_metadata()
        saved = metadata.state_dict_metadata[key]
        full, covered = None, 0
        for chunk in saved.chunks:
            info = metadata.storage_data.get(dcp_meta.MetadataIndex(key, chunk.offsets))
            if info is None:
                raise _refuse(Path(self.path) / METADATA, f"a chunk of {key} has no file", f"lists a chunk of {key} "
                              f"at {tuple(chunk.offsets)} that no file holds; {FIX}")
            with open(Path(self.path) / info.relative_path, "rb") as f:
                f.seek(info.offset)
                piece = torch.load(io.BytesIO(f.read(info.length)), map_location="cpu", weights_only=True)
            if not isinstance(piece, torch.Tensor) or piece.shape != chunk.sizes or \
                    piece.dtype != saved.properties.dtype:
                raise _refuse(Path(self.path) / info.relative_path, "a chunk differs from .metadata",
                              f"holds a chunk of {key} that differs from what {METADATA} says; {FIX}")
            if chunk.sizes == saved.size:
                return piece
            full = torch.empty(tuple(saved.size), dtype=saved.properties.dtype) if full is None else full
            view = full
            for dim, (start, length) in enumerate(zip(chunk.offsets, chunk.sizes)):
                view = view.narrow(dim, start, length)
            view.copy_(piece)
            covered += piece.numel()
        if full is None or covered != full.numel():
            raise _refuse(Path(self.path) / METADATA, f"chunks of {key} do not cover it",
                          f"lists chunks of {key} that do not cover its shape {tuple(saved.size)}; {FIX}")
        return full

    def read_data(self, plan, planner):
        if any(item.type == LoadItemType.BYTE_IO for item in plan.items):
            planner = _WeightsOnlyBytes(planner)
        return super().read_data(plan, planner)


def dcp_load(state: Dict[str, Any], reader: VerifiedFileSystemReader) -> None:
    """dcp.load into `state` in this process alone (no process group), errors as one DataError line."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a single process"
            dcp.load(state, storage_reader=reader, no_dist=True)
    except CheckpointException as err:  # DCP wraps what a rank raised: give the first cause, ours when it is ours
        causes = [getattr(f, "exc", f) for f in err.failures.values()]
        first = next((c for c in causes if isinstance(c, DataError)), causes[0] if causes else err)
        raise DataError(f"checkpoint {reader.path} cannot be loaded ({first})") from None


def empty_like_saved(saved: dcp_meta.TensorStorageMetadata | dcp_meta.BytesStorageMetadata) -> Optional[torch.Tensor]:
    """An uninitialized full tensor of a saved entry's global shape and dtype (None for a non-tensor item)."""
    if isinstance(saved, dcp_meta.BytesStorageMetadata):
        return None
    return torch.empty(tuple(saved.size), dtype=saved.properties.dtype)


def load_sharded_full(folder: str | Path, prefix: str = "model.",
                      reader: Optional[VerifiedFileSystemReader] = None) -> Dict[str, Any]:
    """The full, single-process tensors (and non-tensor items) saved under `prefix`, keyed by the name after it
    ("model." gives GPT.state_dict() names), read in this process without a process group, verified first (pass
    the `reader` of an earlier call to read another prefix without hashing the folder again)."""
    reader = reader if reader is not None else VerifiedFileSystemReader(folder)
    saved = reader.read_metadata().state_dict_metadata
    state = {key: empty_like_saved(md) for key, md in saved.items() if key.startswith(prefix)}
    if not state:
        raise DataError(f"checkpoint {folder} holds nothing under {prefix!r}: keys start with "
                        f"{sorted({k.split('.', 1)[0] + '.' for k in saved})}")
    dcp_load(state, reader)
    return {key[len(prefix):]: value for key, value in state.items()}
