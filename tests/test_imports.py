"""No import circle inside lit_pretrain: the graph of `lit_pretrain.*` imports, read with `ast` (nothing runs).

Every import counts, at module level and inside functions alike: an import deferred into a function only hides a
circle until that function runs (or until someone hoists the import). Edges are the modules an import names; the
parent packages Python also runs on the way are left out, since a package always precedes its submodules.
"""

import ast
import functools
from pathlib import Path
from typing import Dict, List, Optional, Set

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


@functools.cache  # read once per process: two tests walk the package's graph
def import_graph(root: Path = PACKAGE) -> Dict[str, Set[str]]:
    """{module: the package modules it imports}. `from a.b import c` names the submodule a.b.c when there is one,
    else the module a.b (c is then a name defined in it)."""
    modules = module_names(root)
    graph: Dict[str, Set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
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
                    graph[name].add(target)
    return graph


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


# The package's rooms (a top-level module or package) from the ground up: a room imports only rooms below it.
LAYERS = [
    {"errors", "model", "internals"},  # internals: the private Lightning/torch names, importing nothing of ours
    {"paths", "gpu_peaks"},
    {"schema", "runs"},
    {"data", "optim", "schema_doc"},
    {"config"},
    {"resume"},
    {"faults", "interop", "evaluation"},
    {"parallel"},
    {"callbacks"},
    {"module"},
    {"train"},
    {"scaling"},
    {"bench", "cli"},
]
# The imports that still run back up (to a room on the same layer or above), each with why it stays.
BACK_UP = {
    # config.load refuses at load what train would refuse later, so `show` and `train` agree (docs/configuration.md):
    # it checks the plan and the memory fit and budget, which stand above the loader that resume/, interop/,
    # evaluation/ and parallel/launch.py use to read a run's saved config.
    ("lit_pretrain.config", "lit_pretrain.parallel.plan"): "the parallel plan built (and refused) at load",
    ("lit_pretrain.config", "lit_pretrain.scaling.run_plan"): "trainer.tokens_per_param and the memory fit at load",
    # The corpus check's record is written with the checkpoints' atomic writer (temporary file, fsync, rename).
    ("lit_pretrain.data.check_record", "lit_pretrain.resume.atomic"): "atomic_open",
    # A sharded save records each tensor's split under the tensor-parallel layout defined there.
    ("lit_pretrain.resume.sharded.save", "lit_pretrain.parallel.tensor"): "SHARD_DIM, style_of, plain_name",
}


def room(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def test_imports_run_down_the_layers_but_the_listed_ones():
    layer = {name: i for i, rooms in enumerate(LAYERS) for name in rooms}
    graph = import_graph()
    rooms = {room(m) for m in graph} - {""}
    assert rooms <= set(layer), f"place {sorted(rooms - set(layer))} in LAYERS"
    up = {(src, dst) for src, targets in graph.items() for dst in targets
          if room(src) and room(dst) and room(src) != room(dst) and layer[room(dst)] >= layer[room(src)]}
    assert up == set(BACK_UP), f"new: {sorted(up - set(BACK_UP))}; gone: {sorted(set(BACK_UP) - up)}"
