"""Confinement for every delete and replace: the project removes a path only when, after resolving symlinks, it lies
strictly inside a folder the project made, it is not itself a symlink, and it carries the project's mark (a marker
file, or a name of the project's own pattern).

A user-given name is never a path: `SAFE_NAME` is one folder name from a small alphabet, so no `/`, no `..`, no
newline can reach the file system through a config value. The README's "Paths the project deletes or replaces"
lists each site and the check here that guards it.
"""

import re
import shutil
from pathlib import Path
from typing import Callable, Pattern

from lit_pretrain.errors import RunFolderError

# One path component: letters, digits, `.`, `_`, `-`; 1 to 128 of them; not `.` or `..` (which name the folder itself
# or its parent). Nothing else, so names survive shells, SLURM job names and every file system we run on.
SAFE_NAME = r"(?!\.{1,2}\Z)[A-Za-z0-9._-]{1,128}"
SAFE_NAME_RULE = "one folder name of 1 to 128 characters from A-Z a-z 0-9 . _ - (not . or ..), e.g. my-run_1"


def is_safe_name(name: str) -> bool:
    return isinstance(name, str) and re.fullmatch(SAFE_NAME, name) is not None


def is_inside(root: str | Path, path: str | Path) -> bool:
    """True when `path`, symlinks resolved, lies strictly inside `root` (also resolved): never `root` itself."""
    root_resolved = Path(root).resolve()
    return root_resolved in Path(path).resolve().parents


def confined(root: str | Path, child: str | Path, what: str) -> Path:
    """`child` when it is not a symlink and lies strictly inside `root`; a RunFolderError naming `what` otherwise."""
    child = Path(child)
    if child.is_symlink():
        raise RunFolderError(f"{what} {child} is a symbolic link: the project never writes or deletes through a link; "
                             f"remove the link or choose another name")
    if not is_inside(root, child):
        raise RunFolderError(f"{what} {child} resolves to {child.resolve()}, which is not inside "
                             f"{Path(root).resolve()}: refusing to use it")
    return child


def safe_rmtree(folder: str | Path, root: str | Path, is_ours: Callable[[Path], bool], what: str) -> None:
    """Delete `folder` only when it is confined to `root` (see `confined`) and `is_ours(folder)` says the project
    made it. shutil.rmtree does not follow symlinks below the top (it walks by file descriptor on Linux)."""
    folder = confined(root, folder, what)
    if not folder.is_dir():
        raise RunFolderError(f"{what} {folder} is not a folder: refusing to delete it")
    if not is_ours(folder):
        raise RunFolderError(f"{what} {folder} was not made by lit-pretrain (no marker file): refusing to delete it; "
                             "move it away yourself or choose another name")
    shutil.rmtree(folder)


def safe_unlink(path: str | Path, folder: str | Path, pattern: Pattern[str]) -> bool:
    """Delete the file `path` only when its name matches `pattern` and its folder (symlinks resolved) is `folder` or
    lies inside it; a symlink named so is removed as a link, never its target. Returns whether it was allowed."""
    path = Path(path)
    # Resolve the folder part only: the last component is what unlink removes (a link itself, not what it names).
    where = path.parent.resolve()
    root = Path(folder).resolve()
    if not pattern.fullmatch(path.name) or not (where == root or root in where.parents):
        return False
    if path.is_dir() and not path.is_symlink():
        return False
    path.unlink(missing_ok=True)
    return True
