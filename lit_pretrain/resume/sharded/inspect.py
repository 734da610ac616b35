"""`lit-pretrain checkpoint inspect`: step, layout, tensors, bytes and whether every checksum holds, of a sharded
checkpoint folder or a one-file checkpoint. A sharded folder's `.metadata` (a pickle) is parsed only once every
file's checksum holds, and then through the restricted unpickler (resume/sharded/format.py)."""

from pathlib import Path
from typing import Any, Dict, List

import torch
from torch.distributed.checkpoint import metadata as dcp_meta

from lit_pretrain.atomic import file_sha256
from lit_pretrain.errors import DataError
from lit_pretrain.resume.sharded import format as sf
from lit_pretrain.resume.verified import META_KEY, load_verified, verify

MODEL, OPTIM = "model.", "optim."

def _tensor_bytes(values) -> int:
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def _inspect_folder(folder: Path) -> Dict[str, Any]:
    manifest = sf.read_manifest(folder)
    failures: List[str] = []
    try:
        sf.verify_sharded(folder)
    except DataError as err:  # the first failure in full; then every file's own line
        failures.append(str(err))
        for name, record in sorted(manifest["files"].items()):
            path = folder / name
            if not path.is_file():
                failures.append(f"{name}: missing")
            elif path.stat().st_size != record["bytes"]:
                failures.append(f"{name}: {path.stat().st_size} bytes, {sf.MANIFEST} says {record['bytes']}")
            elif file_sha256(path) != record["sha256"]:
                failures.append(f"{name}: sha256 differs from {sf.MANIFEST}")
    report = {"kind": "sharded", "step": manifest["step"], "world_size": manifest["world_size"],
              "layout": manifest.get("layout") or {}, "files": len(manifest["files"]),
              "bytes": sum(r["bytes"] for r in manifest["files"].values()), "failures": failures}
    if not failures:  # .metadata is a pickle: parsed only once its checksum holds
        saved = sf.read_metadata_file(folder / sf.METADATA, manifest["files"]).state_dict_metadata
        tensors = {k: md for k, md in saved.items() if isinstance(md, dcp_meta.TensorStorageMetadata)}
        report["tensors"] = {"model": sum(k.startswith(MODEL) for k in tensors),
                             "optimizer": sum(k.startswith(OPTIM) for k in tensors)}
        report["tensor_bytes"] = sum(torch.Size(md.size).numel() * md.properties.dtype.itemsize
                                     for md in tensors.values())
    return report


def _inspect_file(path: Path) -> Dict[str, Any]:
    report: Dict[str, Any] = {"kind": "single file", "bytes": path.stat().st_size, "files": 1, "failures": []}
    try:
        verify(path)
    except DataError as err:
        report["failures"].append(str(err))
        return report
    state = load_verified(path)
    meta = state.get(META_KEY) or {}
    report.update(step=meta.get("step", state.get("global_step")), world_size=meta.get("world_size"))
    weights = list((state.get("state_dict") or {}).values())
    moments = [v for s in state.get("optimizer_states") or [] for per in (s.get("state") or {}).values()
               for v in per.values()]
    report["tensors"] = {"model": sum(isinstance(v, torch.Tensor) for v in weights),
                         "optimizer": sum(isinstance(v, torch.Tensor) for v in moments)}
    report["tensor_bytes"] = _tensor_bytes(weights) + _tensor_bytes(moments)
    return report


def inspect(path: str | Path) -> Dict[str, Any]:
    """Step, layout, tensors, bytes and checksum failures (an empty list: every checksum holds) of a sharded
    checkpoint folder, a one-file checkpoint, or a run folder's newest checkpoint (the one load_gpt reads:
    checkpoints.checkpoint_path follows last.ckpt, or `latest` when that names a sharded folder); `path` in the
    report is the checkpoint inspected."""
    from lit_pretrain.resume.weights import checkpoint_path

    path = Path(path)
    if path.is_dir() and not sf.is_sharded(path):
        if not (path / "checkpoints").is_dir():
            raise DataError(f"{path} is a folder but neither a sharded checkpoint (no manifest.json, .metadata or "
                            "*.distcp) nor a run folder (no checkpoints/): give runs/<name>, a checkpoints/step*/ "
                            "folder or a .ckpt file")
        path = checkpoint_path(path)
    if sf.is_sharded(path):
        return {"path": str(path), **_inspect_folder(path)}
    if not path.is_file():
        raise DataError(f"checkpoint {path} does not exist: give runs/<name>, a checkpoints/step*/ folder or a .ckpt "
                        "file")
    return {"path": str(path), **_inspect_file(path)}


def format_inspect(path: str | Path, report: Dict[str, Any]) -> str:
    path = report.get("path", path)  # a run folder given: the checkpoint of it inspected
    layout = report.get("layout") or {}
    degrees = " ".join(f"{k}={v}" for k, v in layout.items() if k in (
        "data_parallel_replicate", "data_parallel_shard", "zero_stage", "tensor_parallel", "pipeline_parallel"))
    lines = [f"checkpoint {path} ({report['kind']})", f"step: {report.get('step')}",
             f"layout: world size {report.get('world_size')}" + (f" ({degrees})" if degrees else "")]
    if "tensors" in report:
        t = report["tensors"]
        lines.append(f"tensors: {t['model']} model, {t['optimizer']} optimizer state "
                     f"({report['tensor_bytes']:,} bytes)")
    lines.append(f"files: {report['files']} ({report['bytes']:,} bytes)")
    lines += ["checksums: every file matches"] if not report["failures"] else \
        ["checksums: FAIL"] + [f"  {line}" for line in report["failures"]]
    return "\n".join(lines)
