"""The repository stands alone: no file cites the workspace's shared folder (a reader does not have it; docs/cpu.md
holds what the code relied on from it) or a ticket by its number (which means nothing to a reader: say what)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ["lit_pretrain", "tests", "docs", "experiments", "README.md", "Makefile", "pyproject.toml"]
TEXT = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".json", ".sh", ""}
# Written in pieces so this file does not match itself. `/shared/web` in docs/data.md is a reader's own path.
SHARED = re.compile(r"(?<![\w/])" + "shared" + r"/|\.\./" + "shared" + r"\b")
TICKET = re.compile(r"\b" + "issues?" + r" #?\d+", re.IGNORECASE)


def files():
    for name in SCANNED:
        path = ROOT / name
        for f in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if f.is_file() and f.suffix in TEXT and "__pycache__" not in f.parts and f.stat().st_size < 2_000_000:
                yield f


def hits(pattern):
    found = []
    for f in files():
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    return found


def test_the_patterns_catch_what_they_are_for():
    assert SHARED.search("(sha" + "red/CPU-DISTRIBUTED.md, pitfall 2)") and SHARED.search("../sha" + "red/data")
    assert not SHARED.search("data.paths='[/sha" + "red/web]'")
    assert TICKET.search("(Iss" + "ue 21's variants)") and TICKET.search("see iss" + "ue #7")
    assert not TICKET.search("pytorch#87997")


def test_no_file_cites_the_shared_folder():
    assert not hits(SHARED), "cite a docs/ page (docs/cpu.md for CPU measurements) instead:\n" + "\n".join(hits(SHARED))


def test_no_file_cites_a_ticket_number():
    assert not hits(TICKET), "say what, not which ticket:\n" + "\n".join(hits(TICKET))
