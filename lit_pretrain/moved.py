"""Modules that moved when the package was regrouped into folders by role, and the finder that still answers their
old names: `import lit_pretrain.parallel.plan` imports lit_pretrain.planning.plan, the same module object (so a
patch through either name patches both), and warns once, in one line, with the new name. `python -m` of an old
name runs the new module. The table is data, written with the move; the finder stands first on sys.meta_path but
answers only the names listed here, and only where the new module exists."""

import importlib
import importlib.util
import sys
import warnings

MOVED = {
    "lit_pretrain.data.corpus": "lit_pretrain.data.preparation.corpus",
    "lit_pretrain.data.deduplicate": "lit_pretrain.data.preparation.deduplicate",
    "lit_pretrain.data.deduplication_report": "lit_pretrain.data.preparation.deduplication_report",
    "lit_pretrain.data.lsh": "lit_pretrain.data.preparation.lsh",
    "lit_pretrain.data.minhash": "lit_pretrain.data.preparation.minhash",
    "lit_pretrain.data.prepare": "lit_pretrain.data.preparation.prepare",
    "lit_pretrain.data.progress": "lit_pretrain.data.preparation.progress",
    "lit_pretrain.data.quality": "lit_pretrain.data.preparation.quality",
    "lit_pretrain.data.ray_engine": "lit_pretrain.data.preparation.ray_engine",
    "lit_pretrain.data.readers": "lit_pretrain.data.preparation.readers",
    "lit_pretrain.data.tokenize_stage": "lit_pretrain.data.preparation.tokenize_stage",
    "lit_pretrain.data.workers": "lit_pretrain.data.preparation.workers",
    "lit_pretrain.faults": "lit_pretrain.launch",
    "lit_pretrain.faults.launcher": "lit_pretrain.launch.launcher",
    "lit_pretrain.faults.supervisor": "lit_pretrain.launch.supervisor",
    "lit_pretrain.faults.watchdog": "lit_pretrain.launch.watchdog",
    "lit_pretrain.parallel.batch": "lit_pretrain.planning.batch",
    "lit_pretrain.parallel.compile_policy": "lit_pretrain.planning.compile_policy",
    "lit_pretrain.parallel.float8_policy": "lit_pretrain.planning.float8_policy",
    "lit_pretrain.parallel.launch": "lit_pretrain.launch.commands",
    "lit_pretrain.parallel.layout": "lit_pretrain.planning.layout",
    "lit_pretrain.parallel.memory_log": "lit_pretrain.callbacks.memory_log",
    "lit_pretrain.parallel.mesh_strategy": "lit_pretrain.strategy.mesh_strategy",
    "lit_pretrain.parallel.plan": "lit_pretrain.planning.plan",
    "lit_pretrain.parallel.startup": "lit_pretrain.launch.startup",
    "lit_pretrain.parallel.strategies": "lit_pretrain.strategy.build",
    "lit_pretrain.parallel.world": "lit_pretrain.launch.world",
    "lit_pretrain.resume.atomic": "lit_pretrain.atomic",
    "lit_pretrain.scaling.communication": "lit_pretrain.planning.communication",
    "lit_pretrain.scaling.ladder_grid": "lit_pretrain.scaling.ladder.grid",
    "lit_pretrain.scaling.ladder_law": "lit_pretrain.scaling.ladder.law",
    "lit_pretrain.scaling.ladder_picture": "lit_pretrain.scaling.ladder.picture",
    "lit_pretrain.scaling.ladder_pool": "lit_pretrain.scaling.ladder.pool",
    "lit_pretrain.scaling.ladder_report": "lit_pretrain.scaling.ladder.report",
    "lit_pretrain.scaling.ladder_rules": "lit_pretrain.scaling.ladder.rules",
    "lit_pretrain.scaling.ladder_rung": "lit_pretrain.scaling.ladder.rung",
    "lit_pretrain.scaling.ladder_state": "lit_pretrain.scaling.ladder.state",
    "lit_pretrain.scaling.ladder_worker": "lit_pretrain.scaling.ladder.worker",
    "lit_pretrain.scaling.laws": "lit_pretrain.planning.laws",
    "lit_pretrain.scaling.memory": "lit_pretrain.planning.memory",
    "lit_pretrain.scaling.plan": "lit_pretrain.planning.compute_optimal",
    "lit_pretrain.scaling.recompute": "lit_pretrain.planning.recompute",
    "lit_pretrain.scaling.run_plan": "lit_pretrain.planning.run_plan",
}


class _Alias:
    # The loader protocol by its methods, not importlib.abc's base classes: importing importlib.abc pulls in
    # importlib.resources (~16 ms), on every command's start.
    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def notice(self) -> None:
        warnings.warn(f"{self.old} moved to {self.new}: import the new name", FutureWarning, stacklevel=3)

    def create_module(self, spec):
        self.notice()
        return importlib.import_module(self.new)

    def exec_module(self, module):
        """The module is the new one, already run."""

    def get_code(self, fullname):  # `python -m OLD`: runpy runs the new module's code as __main__
        self.notice()
        return importlib.util.find_spec(self.new).loader.get_code(self.new)

    def is_package(self, fullname):
        return importlib.util.find_spec(self.new).submodule_search_locations is not None


class MovedFinder:  # the meta path finder protocol (find_spec), as _Alias
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        try:
            if importlib.util.find_spec(new) is None:
                return None
        except ModuleNotFoundError:  # a tree not moved yet: the old module is still where its name says
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(fullname, new))


def install() -> None:
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
