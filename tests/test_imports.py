"""No import circle inside lit_pretrain and no import running back up its layers: the graph of `lit_pretrain.*`
imports, read with `ast` (nothing runs); and the old names of moved modules still answer.

Every import counts, at module level and inside functions alike: an import deferred into a function only hides a
circle until that function runs (or until someone hoists the import). Edges are the modules an import names; the
parent packages Python also runs on the way are left out, since a package always precedes its submodules.
"""

import ast
import functools
import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import pytest

from lit_pretrain.moved import MOVED

PACKAGE = Path(__file__).resolve().parents[1] / "lit_pretrain"


def module_names(root: Path = PACKAGE) -> Dict[str, Path]:
    """{dotted name: file} of every module of the package (a package by its __init__.py)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules) -> List[Tuple[str, int]]:
    """(package module imported, line) for every import in the module `name` at `path`. `from a.b import c` names
    the submodule a.b.c when there is one, else the module a.b (c is then a name defined in it)."""
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: List[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        for target in targets:
            while target and target not in modules:  # `import a.b.c as x` where c is not a module
                target = target.rpartition(".")[0]
            if target and target != name:
                out.append((target, node.lineno))
    return out


@functools.cache  # read once per process: two tests walk the package's graph
def import_graph(root: Path = PACKAGE) -> Dict[str, Set[str]]:
    """{module: the package modules it imports} (imports_of)."""
    modules = module_names(root)
    return {name: {target for target, _ in imports_of(name, path, modules)} for name, path in modules.items()}


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One import circle as [a, b, ..., a], or None. Depth-first search, in sorted order so the report is stable."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_find_cycle_reports_a_circle_and_passes_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_import_graph_reads_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "lit_pretrain"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import leaf\n")
    (pkg / "sub" / "leaf.py").write_text("def f():\n    from lit_pretrain.top import g\n")
    (pkg / "top.py").write_text("from lit_pretrain.sub import leaf\n")
    graph = import_graph(pkg)
    assert graph["lit_pretrain.sub"] == {"lit_pretrain.sub.leaf"}
    assert graph["lit_pretrain.sub.leaf"] == {"lit_pretrain.top"}  # inside a function, still an edge
    assert find_cycle(graph) == ["lit_pretrain.sub.leaf", "lit_pretrain.top", "lit_pretrain.sub.leaf"]


def test_lit_pretrain_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


# The package's rooms (a top-level module or package) from the ground up: a room imports only rooms below it, so
# each row may import every row above it and none below (the allowed directions). docs/layout.md draws the same.
LAYERS = [
    # internals: the private Lightning/torch names, importing nothing of ours
    {"errors", "model", "moved", "internals"},
    {"paths", "gpu_peaks", "planning"},  # planning: pure functions of the config, below the config that calls them
    {"atomic", "schema", "runs"},
    {"data", "optim", "schema_doc"},
    {"config"},
    {"resume"},
    {"launch", "interop", "evaluation"},
    {"parallel"},  # the plan applied to the GPT (torch transforms)
    {"strategy"},  # the Lightning glue of those transforms
    {"callbacks"},
    {"module"},
    {"train"},
    {"scaling", "simulate"},  # simulate: a run's step on a fake process group, beside the planners it checks
    {"bench", "cli"},
]
# The planning package is what the config load runs before any heavy import (`show` in well under a second); what it
# may import of the package besides itself: the errors and the architecture's table and counts (both torch-free).
PLANNING_MAY_IMPORT = {"lit_pretrain.errors", "lit_pretrain.model", "lit_pretrain.model.config",
                       "lit_pretrain.model.shapes", "lit_pretrain.model.mask_spec"}


def room(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def imports_running_up(root: Path = PACKAGE) -> List[str]:
    """Every import, at module level or in a function, from a room to one on its own layer or above, as
    "file:line: module imports target (layer a -> layer b)"."""
    layer = {name: i for i, rooms in enumerate(LAYERS) for name in rooms}
    modules = module_names(root)
    rooms = {room(m) for m in modules} - {""}
    assert rooms <= set(layer), f"place {sorted(rooms - set(layer))} in LAYERS"
    out = []
    for name, path in modules.items():
        for target, line in imports_of(name, path, modules):
            src, dst = room(name), room(target)
            if src and dst and src != dst and layer[dst] >= layer[src]:
                out.append(f"{path.relative_to(root.parent)}:{line}: {name} imports {target} "
                           f"(layer {layer[src]} -> {layer[dst]})")
    return sorted(out)


def test_imports_run_down_the_layers():
    up = imports_running_up()
    assert not up, "imports running back up:\n" + "\n".join(up)


def test_layering_check_names_an_import_running_up(tmp_path):
    pkg = tmp_path / "lit_pretrain"
    (pkg / "planning").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "planning" / "__init__.py").write_text("")
    (pkg / "planning" / "plan.py").write_text("import math\n\n\ndef f():\n    from lit_pretrain import config\n")
    (pkg / "config.py").write_text("from lit_pretrain.planning import plan\n")  # downward: allowed
    assert imports_running_up(pkg) == [
        "lit_pretrain/planning/plan.py:5: lit_pretrain.planning.plan imports lit_pretrain.config (layer 1 -> 4)"]


def test_planning_imports_neither_torch_nor_lightning():
    modules = {m: p for m, p in module_names().items() if room(m) == "planning"}
    assert len(modules) > 10, sorted(modules)  # the package is there and whole
    for name, path in modules.items():
        for target, line in imports_of(name, path, module_names()):
            assert room(target) == "planning" or target in PLANNING_MAY_IMPORT, f"{path}:{line} imports {target}"
    # what an import runs, not only what it names: no module of the package brings in torch or Lightning
    code = ("import sys\n" + "".join(f"import {m}\n" for m in sorted(modules)) +
            "print(sorted(m for m in ('torch', 'lightning', 'pytorch_lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_every_moved_name_answers_with_its_new_module():
    with warnings.catch_warnings():  # finding lit_pretrain.launch.x imports its old package's name: a notice
        warnings.simplefilter("ignore", FutureWarning)
        for old, new in MOVED.items():
            assert importlib.util.find_spec(new) is not None, f"moved.py: {old} -> {new}, which is not there"
            assert importlib.util.find_spec(old).loader.new == new, old  # the finder answers, not a stale file
    old, new = next((o, n) for o, n in sorted(MOVED.items()) if o.count(".") == 2 and n.count(".") == 2)
    sys.modules.pop(old, None)
    with pytest.warns(FutureWarning, match=f"^{old} moved to {new}: import the new name$"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)  # one module object: a patch through either name patches both


def test_python_dash_m_of_an_old_name_runs_the_new_module():
    old = next(o for o, n in MOVED.items() if n == "lit_pretrain.launch.commands")
    out = subprocess.run([sys.executable, "-m", old, "--help"], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout and f"{old} moved to lit_pretrain.launch.commands" in out.stderr
