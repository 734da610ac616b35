"""The checkpoints folder of a run: step files, the `latest` pointer, `last.ckpt`, retention, and the resolver for
`run.resume`.

Order of writes for a new checkpoint (each atomic): the step file and its sidecar, then `last.ckpt` (a hard link to
it) and its sidecar, then the `latest` pointer, then retention. A crash at any point leaves `latest` naming a
complete, verified checkpoint. Retention deletes only step files older than the newest k *valid* ones, so it never
deletes the only (or the newest) valid checkpoint.
"""

import re
from pathlib import Path
from typing import List, Optional

from lit_pretrain.errors import ConfigError, DataError
from lit_pretrain.paths import safe_unlink
from lit_pretrain.resume.atomic import atomic_link, atomic_write_bytes
from lit_pretrain.resume.checkpoint_io import read_sidecar, sidecar_path, verify

LATEST = "latest"
LAST = "last.ckpt"
STEP_FILE = re.compile(r"^step(\d{7,})\.ckpt$")
STEP_SIDECAR = re.compile(r"^step\d{7,}\.ckpt\.json$")


def step_file(step: int) -> str:
    return f"step{step:07d}.ckpt"


def step_files(folder: Path) -> List[Path]:
    """Step checkpoints in the folder, oldest first."""
    found = [(int(m.group(1)), p) for p in folder.glob("step*.ckpt") if (m := STEP_FILE.match(p.name))]
    return [p for _, p in sorted(found)]


def is_valid(path: Path, check_sha256: bool = True) -> bool:
    try:
        verify(path, check_sha256)
        return True
    except DataError:
        return False


def publish(folder: Path, path: Path) -> None:
    """After `path` (a verified step file) is written: point `last.ckpt` and `latest` at it."""
    atomic_link(path, folder / LAST)
    atomic_link(sidecar_path(path), sidecar_path(folder / LAST))
    atomic_write_bytes(folder / LATEST, (path.name + "\n").encode())


def retain(folder: Path, keep_last: int) -> List[Path]:
    """Delete step files older than the newest `keep_last` valid ones (0 keeps all); return what was deleted.

    Validity is checked by size only (the sha256 was taken as each was written); a file that fails it is never
    counted toward the k kept, so a corrupted newest file cannot push the last good one out.
    """
    if keep_last <= 0:
        return []
    files = step_files(folder)
    kept, deleted = 0, []
    for path in reversed(files):
        if kept < keep_last:
            kept += is_valid(path, check_sha256=False)
            continue
        # Only names of STEP_FILE's pattern (and their sidecars) directly in this checkpoints folder.
        if safe_unlink(path, folder, STEP_FILE):
            safe_unlink(sidecar_path(path), folder, STEP_SIDECAR)
            deleted.append(path)
    return deleted


def newest_valid(folder: Path) -> Optional[Path]:
    """The checkpoint `latest` names if it verifies, else the newest step file that verifies, else None."""
    pointer = folder / LATEST
    if pointer.is_file():
        named = folder / pointer.read_text().strip()
        if named.parent == folder and is_valid(named):
            return named
    for path in reversed(step_files(folder)):
        if is_valid(path):
            return path
    return None


def resolve(resume: Optional[str], run_dir: Path) -> Optional[Path]:
    """The checkpoint to resume from: None (start afresh), `auto` (the newest valid one of this run, or afresh when
    the run has none) or a path (which must verify)."""
    if resume is None:
        return None
    folder = run_dir / "checkpoints"
    if resume == "auto":
        found = newest_valid(folder) if folder.is_dir() else None
        if found is None and folder.is_dir() and step_files(folder):
            raise DataError(f"run.resume=auto: no checkpoint in {folder} passes its checksum "
                            f"({', '.join(p.name for p in step_files(folder))}): resume from a given file with "
                            "run.resume=PATH, or start afresh with run.overwrite=true")
        return found
    path = Path(resume)
    if not path.is_file():
        raise ConfigError(f"run.resume={resume}: no such checkpoint file; give a file written by a run "
                          f"(runs/<name>/checkpoints/step*.ckpt) or run.resume=auto")
    verify(path)
    return path


def describe(path: Path) -> str:
    side = read_sidecar(path) or {}
    return f"{path} (step {side.get('meta', {}).get('step', '?')})"
