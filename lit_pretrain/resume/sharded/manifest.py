"""The manifest of a sharded checkpoint folder: written last, verified before anything of the folder is read.

`manifest.json` lists every other file of the folder with its size and sha256; rank 0 writes it atomically once
every rank's files are complete, so a folder without one is an incomplete save and is never read. `verify_sharded`
checks that every listed file is present, none unlisted, and each size and sha256. resume/sharded/format.py reads
the folder after it (and re-exports these names).
"""

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Dict, Iterable, Mapping

from lit_pretrain.atomic import atomic_write_bytes, file_sha256
from lit_pretrain.errors import DataError
from lit_pretrain.resume.verified import _refuse

FORMAT = "lit-pretrain-sharded/1"
MANIFEST, METADATA, TRAINER_STATE = "manifest.json", ".metadata", "trainer_state.pt"
STEP_FOLDER = re.compile(r"^step(\d{7,})$")
# The files a save makes; each must be in the manifest (an unlisted one is left from another save, or planted).
SAVED_FILE = re.compile(r"^(.+\.distcp|(__\d+)?\.metadata|.+\.pt)$")
FIX = "choose another checkpoint (run.resume=auto picks the newest complete one)"


def file_record(path: str | Path) -> Dict[str, Any]:
    """{"bytes", "sha256"} of a file: one read (atomic.py's hashing) and a stat."""
    return {"bytes": Path(path).stat().st_size, "sha256": file_sha256(path)}


def _plain_name(folder: Path, name: Any) -> str:
    # A manifest names files of its own folder only: never a path that could reach outside it.
    if not isinstance(name, str) or not name or name in (".", "..", MANIFEST) or Path(name).name != name:
        raise _refuse(folder / MANIFEST, "names a file outside its folder", f"names {name!r}, not a file of "
                      f"{folder}: it was not written by this project; {FIX}")
    return name


def _saved_files(folder: Path) -> Iterable[Path]:
    return (p for p in folder.iterdir() if SAVED_FILE.match(p.name) and not p.is_dir())


def write_manifest(folder: str | Path, files: Mapping[str, Dict] | Iterable[str], meta: Dict, layout: Any,
                   step: int, world_size: int) -> Dict:
    """Write `folder/manifest.json` (atomic; file and folder fsynced) once every other file is complete, and return
    it. `files`: {name: file_record} (ranks hash their own files) or names to hash here; each is checked against the
    folder's sizes, and a saved file the manifest would not list is refused (verify_sharded would refuse it later)."""
    folder = Path(folder)
    if not isinstance(files, Mapping):
        files = {name: file_record(folder / _plain_name(folder, name)) for name in files}
    records = {}
    for name, record in sorted(files.items()):
        path = folder / _plain_name(folder, name)
        if not path.is_file() or path.stat().st_size != record["bytes"]:
            raise DataError(f"checkpoint file {path}: missing or not {record['bytes']} bytes when its manifest was "
                            "written: every rank's files must be complete before the manifest")
        records[name] = {"bytes": int(record["bytes"]), "sha256": str(record["sha256"])}
    stray = sorted(p.name for p in _saved_files(folder) if p.name not in records)
    if stray or METADATA not in records:
        raise DataError(f"checkpoint {folder}: the manifest would leave out {stray or [METADATA]}: list every file "
                        "of the save (and DCP's .metadata)")
    plan = dataclasses.asdict(layout) if dataclasses.is_dataclass(layout) else dict(layout or {})
    manifest = {"format": FORMAT, "step": int(step), "files": records, "meta": dict(meta or {}), "layout": plan,
                "world_size": int(world_size)}
    atomic_write_bytes(folder / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    return manifest


def is_sharded(path: str | Path) -> bool:
    """Whether `path` is a sharded checkpoint folder (complete or not), as opposed to a file or a run folder."""
    path = Path(path)
    return path.is_dir() and (any((path / n).exists() for n in (MANIFEST, METADATA, TRAINER_STATE))
                              or any(path.glob("*.distcp")))


def read_manifest(folder: str | Path) -> Dict:
    """The manifest of a sharded checkpoint, its shape checked; a DataError naming the file otherwise."""
    folder = Path(folder)
    path = folder / MANIFEST
    if folder.is_file():
        raise _refuse(folder, "it is a file", "is one file, not a sharded checkpoint folder (checkpoints/step*/)")
    if not folder.is_dir():
        raise _refuse(folder, "it does not exist", f"does not exist: give a checkpoint folder checkpoints/step*/; "
                      f"{FIX}")
    if not path.is_file():
        raise _refuse(folder, f"no {MANIFEST} (incomplete)", f"has no {MANIFEST}: it is incomplete (a save that did "
                      f"not finish, or a copy without its manifest); {FIX}")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise _refuse(path, f"{MANIFEST} is unreadable", f"is not readable JSON ({err}); {FIX}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise _refuse(path, f"unknown format {found!r}", f"has format {found!r}, not {FORMAT!r}: written by another "
                      f"program or version; {FIX}")
    files, step = manifest.get("files"), manifest.get("step")
    if not isinstance(files, dict) or not isinstance(step, int) or not isinstance(manifest.get("world_size"), int) \
            or not all(isinstance(r, dict) and isinstance(r.get("bytes"), int) and isinstance(r.get("sha256"), str)
                       for r in files.values()):
        raise _refuse(path, f"{MANIFEST} is malformed", f"lacks step, world_size or a bytes/sha256 record per file: "
                      f"not written by this project; {FIX}")
    for name in files:
        _plain_name(folder, name)
    return manifest


def verify_sharded(folder: str | Path, check_sha256: bool = True) -> Dict:
    """The manifest of a complete, intact sharded checkpoint; otherwise a DataError (with `.reason`) naming the
    file: no manifest, a listed file missing, an unlisted saved file present, a size or sha256 that differs, a
    manifest of another step or format. Sizes and presence are checked for every file before any is hashed."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    files, step = manifest["files"], manifest["step"]
    named = STEP_FOLDER.match(folder.name)
    meta_step = (manifest.get("meta") or {}).get("step", step)
    if (named and int(named.group(1)) != step) or meta_step != step:
        raise _refuse(folder / MANIFEST, f"it says step {step}", f"says step {step} (its metadata {meta_step}) in "
                      f"folder {folder.name}: it belongs to another checkpoint; {FIX}")
    if METADATA not in files:
        raise _refuse(folder / MANIFEST, f"no {METADATA} listed", f"lists no {METADATA}: not a DCP checkpoint; {FIX}")
    for name, record in files.items():
        path = folder / name
        if not path.is_file():
            raise _refuse(path, "a listed file is missing", f"is missing (listed in {MANIFEST}): copy the whole "
                          f"folder; {FIX}")
        if path.stat().st_size != record["bytes"]:
            raise _refuse(path, f"{path.stat().st_size} bytes, the manifest says {record['bytes']}",
                          f"is truncated or overwritten: {path.stat().st_size} bytes, {MANIFEST} says "
                          f"{record['bytes']}; {FIX}")
    for path in _saved_files(folder):
        if path.name not in files:
            raise _refuse(path, f"not listed in {MANIFEST}", f"is not listed in {MANIFEST}: left by another save or "
                          f"added since; remove it or {FIX}")
    if check_sha256:
        for name, record in files.items():
            if file_sha256(folder / name) != record["sha256"]:
                raise _refuse(folder / name, f"sha256 differs from {MANIFEST}", f"is corrupted: its sha256 differs "
                              f"from {MANIFEST}; {FIX}")
    return manifest
