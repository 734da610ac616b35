"""The checkpoints folder of a run: step files, step folders (the sharded format, resume/sharded/save.py), the `latest`
pointer, `last.ckpt`, retention, and the resolver for `run.resume`.

A step file `step0000012.ckpt` counts when its sha256 sidecar agrees; a step folder `step0000012/` when its
manifest.json (written last) lists every file with the right size and sha256. `latest` names either; `last.ckpt` is
a hard link to the newest step file and is removed when a folder is published (`latest` is then the pointer).

Order of writes for a new checkpoint (each atomic): the step file and its sidecar, then `last.ckpt` (a hard link to
it) and its sidecar, then the `latest` pointer, then retention. A crash at any point leaves `latest` naming a
complete, verified checkpoint. Retention deletes only step files older than the newest k *valid* ones, so it never
deletes the only (or the newest) valid checkpoint.
"""

import itertools
import os
import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from lit_pretrain.atomic import atomic_link, atomic_write_bytes, fsync_dir
from lit_pretrain.errors import ConfigError, DataError
from lit_pretrain.paths import confined, safe_rmtree, safe_unlink
from lit_pretrain.resume.sharded.manifest import read_manifest, verify_sharded
from lit_pretrain.resume.verified import read_sidecar, sidecar_path, verify
from lit_pretrain.runs.folder import is_primary_process

LATEST = "latest"
LAST = "last.ckpt"
STEP_FILE = re.compile(r"^step(\d{7,})\.ckpt$")
STEP_DIR = re.compile(r"^step(\d{7,})$")
STEP_SIDECAR = re.compile(r"^step\d{7,}\.ckpt\.json$")
CORRUPT = ".corrupt"  # suffix of a checkpoint set aside after failing its checksum (never read, never retained)
DIVERGED = ".diverged"  # suffix of a checkpoint set aside because it holds a diverged run's weights (withdraw_after)


def step_file(step: int) -> str:
    return f"step{step:07d}.ckpt"


def step_dir(step: int) -> str:
    return f"step{step:07d}"


def is_step_dir(path: Path) -> bool:
    """A step folder of the sharded format: the name pattern, a real folder (never a link)."""
    return STEP_DIR.match(path.name) is not None and path.is_dir() and not path.is_symlink()


def step_files(folder: Path) -> List[Path]:
    """Step checkpoints in the folder (files and sharded folders), oldest first; a file before a folder of the same
    step (a run that changed format keeps both)."""
    found = [(int(m.group(1)), 0, p) for p in folder.glob("step*.ckpt") if (m := STEP_FILE.match(p.name))]
    found += [(int(m.group(1)), 1, p) for p in folder.glob("step*") if (m := STEP_DIR.match(p.name)) and is_step_dir(p)]
    return [p for _, _, p in sorted(found)]


def verify_any(path: Path, check_sha256: bool = True) -> Dict:
    """A step file against its sidecar, or a step folder against its manifest; the sidecar/manifest, or a
    DataError (with `.reason`) naming the file."""
    if path.is_dir():
        return verify_sharded(path, check_sha256=check_sha256)
    return verify(path, check_sha256)


def meta_of(path: Path) -> Dict:
    """The `lit_pretrain` metadata of a checkpoint (its sidecar's or manifest's), {} when unreadable."""
    if path.is_dir():
        try:
            return read_manifest(path).get("meta") or {}
        except DataError:
            return {}
    return (read_sidecar(path) or {}).get("meta", {})


def is_valid(path: Path, check_sha256: bool = True) -> bool:
    try:
        verify_any(path, check_sha256)
        return True
    except DataError:
        return False


def publish(folder: Path, path: Path) -> None:
    """After `path` (a verified step file or folder) is written: point `last.ckpt` (files) and `latest` at it."""
    if path.is_dir():
        # `latest` is the pointer now; a last.ckpt left from a one-file session would name an older checkpoint.
        safe_unlink(folder / LAST, folder, re.compile(re.escape(LAST)))
        safe_unlink(sidecar_path(folder / LAST), folder, re.compile(re.escape(LAST + ".json")))
    else:
        # The folder's one fsync is `latest`'s, after both links (atomic.py): a crash before it can lose a
        # link, never leave one naming a half-written file, and `latest` is read first anyway.
        atomic_link(path, folder / LAST, sync_folder=False)
        atomic_link(sidecar_path(path), sidecar_path(folder / LAST), sync_folder=False)
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
        if path.is_dir():
            remove_step_dir(path, folder)
            deleted.append(path)
            continue
        # Only names of STEP_FILE's pattern (and their sidecars) directly in this checkpoints folder.
        if safe_unlink(path, folder, STEP_FILE):
            safe_unlink(sidecar_path(path), folder, STEP_SIDECAR)
            deleted.append(path)
    return deleted


def remove_step_dir(path: Path, folder: Path) -> None:
    """Delete a step folder: only a folder of STEP_DIR's pattern directly inside this checkpoints folder, never
    through a link (paths.safe_rmtree)."""
    safe_rmtree(path, folder, lambda p: is_step_dir(p) and p.parent.resolve() == Path(folder).resolve(),
                "checkpoint folder")


def step_of(path: Path) -> int:
    m = STEP_FILE.match(path.name) or STEP_DIR.match(path.name)
    return int(m.group(1)) if m else -1


def scan(folder: Path) -> Tuple[Optional[Path], List[Tuple[Path, str]]]:
    """The checkpoint to resume from (the one `latest` names if it verifies, else the newest step file that
    verifies, else None) and the step files newer than it that fail verification, each with the reason."""
    found, skipped = None, []
    pointer = folder / LATEST
    if pointer.is_file():
        named = folder / pointer.read_text().strip()
        if named.parent == folder and (STEP_FILE.match(named.name) or STEP_DIR.match(named.name)) \
                and is_valid(named):
            found = named
    for path in reversed(step_files(folder)):
        if found is not None and step_of(path) <= step_of(found):
            break
        try:
            verify_any(path)
        except DataError as err:
            skipped.append((path, getattr(err, "reason", str(err))))
            continue
        if found is None:
            found = path
            break
        # A valid step file newer than `latest` (a crash before publishing it): the resumed run rewrites it.
    return found, skipped


def resumable_step(folder: Path) -> Optional[int]:
    """The step of the newest checkpoint whose size matches its sidecar or manifest (no sha256 pass: for a message,
    not for loading), None when there is none."""
    return next((step_of(p) for p in reversed(step_files(folder)) if is_valid(p, check_sha256=False)), None)


def latest_path(folder: Path) -> Optional[Path]:
    """The checkpoint the `latest` pointer names (written only after it was complete), None without a pointer."""
    pointer = folder / LATEST
    if not pointer.is_file():
        return None
    named = folder / pointer.read_text().strip()
    return named if STEP_FILE.match(named.name) or STEP_DIR.match(named.name) else None


def size_of(path: Path) -> int:
    """Bytes of a step file, or of the files in a step folder."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size if path.is_file() else 0


def newest_valid(folder: Path) -> Optional[Path]:
    """The checkpoint `latest` names if it verifies, else the newest step file that verifies, else None."""
    return scan(folder)[0]


def set_aside(path: Path, suffix: str = CORRUPT) -> Path:
    """Rename a checkpoint that failed verification (and its sidecar) to `<name>.corrupt`, or `<name>.<n>.corrupt`
    when that is taken, in its own folder, so that a later save of the same step cannot overwrite it and it stays
    for inspection (`suffix`: DIVERGED for a diverged run's). A hard link then an unlink: the new name is never an
    existing file."""
    for n in itertools.count():
        aside = path.with_name(f"{path.name}{'' if n == 0 else f'.{n}'}{suffix}")
        if aside.exists() or aside.is_symlink() or sidecar_path(aside).exists():
            continue
        if path.is_dir():
            # A step folder: renamed within its own folder (nothing deleted); the new name is checked free above.
            confined(path.parent, path, "checkpoint folder")
            os.rename(path, aside)
            fsync_dir(path.parent)
            return aside
        try:
            os.link(path, aside)
        except FileExistsError:
            continue
        if sidecar_path(path).exists():
            os.link(sidecar_path(path), sidecar_path(aside))
            safe_unlink(sidecar_path(path), path.parent, STEP_SIDECAR)
        safe_unlink(path, path.parent, STEP_FILE)  # a step file of this folder: scan() found it by that pattern
        fsync_dir(path.parent)
        return aside


def withdraw_after(folder: Path, step: int) -> Tuple[Optional[Path], List[Path]]:
    """After a run diverged: set aside (`<name>.diverged`) every step checkpoint newer than `step`, the newest step
    whose weights are healthy, and point `latest` and `last.ckpt` at the newest valid checkpoint left, or remove
    them when none is left, so that neither run.resume=auto nor load_gpt reads the diverged weights. Returns that
    checkpoint (None: none) and the paths set aside (their new names). Rank 0 only, once every write has ended."""
    aside = [set_aside(path, DIVERGED) for path in step_files(folder) if step_of(path) > step]
    kept = next((p for p in reversed(step_files(folder)) if is_valid(p, check_sha256=False)), None)
    if kept is not None:
        publish(folder, kept)
    else:
        for name in (LATEST, LAST, LAST + ".json"):
            safe_unlink(folder / name, folder, re.compile(re.escape(name)))
    return kept, aside


def resolve(resume: Optional[str], run_dir: Path) -> Optional[Path]:
    """The checkpoint to resume from: None (start afresh), `auto` (the newest valid one of this run, or afresh when
    the run has none) or a path (which must verify).

    `auto` says which newer step files it skipped and why, sets them aside (set_aside) and points `last.ckpt` and
    `latest` at the checkpoint it resumes from. Runs in the primary process only (resume.session.open_run).
    """
    if resume is None:
        return None
    folder = run_dir / "checkpoints"
    if resume == "auto":
        found, skipped = scan(folder) if folder.is_dir() else (None, [])
        if found is None and folder.is_dir() and step_files(folder):
            raise DataError(f"run.resume=auto: no checkpoint in {folder} passes its checksum "
                            f"({', '.join(p.name for p in step_files(folder))}): resume from a given file with "
                            "run.resume=PATH, or start afresh with run.overwrite=true")
        if skipped and is_primary_process():
            for path, why in skipped:
                aside = set_aside(path)
                print(f"run.resume=auto: skipped {folder.name}/{path.name} ({why}); kept aside as {aside.name}",
                      flush=True)
            publish(folder, found)
        return found
    path = Path(resume)
    if not (path.is_file() or path.is_dir() and (path / "manifest.json").exists() or is_step_dir(path)):
        raise ConfigError(f"run.resume={resume}: no such checkpoint file or folder; give one written by a run "
                          f"(runs/<name>/checkpoints/step*.ckpt, or a sharded step* folder) or run.resume=auto")
    verify_any(path)
    return path


def describe(path: Path) -> str:
    return f"{path} (step {meta_of(path).get('step', '?')})"
