"""One rung of the ladder in a worker process: `python -m lit_pretrain.scaling.ladder.worker GRID RUNG`, started by
pool.py. It stands above grid.py (the grid and its rungs) and rung.py (training one), which import
neither it nor each other at the top, so the ladder's modules hold no import circle (tests/test_imports.py)."""

import sys
import traceback
from pathlib import Path

from lit_pretrain.scaling.ladder import grid as ladder_grid
from lit_pretrain.scaling.ladder.rung import LadderSignals, RungOutput, train_rung


def main(argv=None) -> int:
    """`python -m lit_pretrain.scaling.ladder.worker GRID RUNG`: one rung in a worker process of the ladder
    (pool.py); exit 0 when it finished or a signal stopped it at a checkpoint (its summary says which)."""
    grid_path, name = argv if argv is not None else sys.argv[1:]
    grid = ladder_grid.load_grid(grid_path)
    rung = next(r for r in ladder_grid.plan_rungs(grid, Path(grid_path)) if r["name"] == name)
    signals = LadderSignals().install()
    output = RungOutput(Path(grid.root_dir), Path(grid.root_dir) / name)
    try:
        train_rung(grid, rung, signals, output)
    except BaseException:
        log = Path(grid.root_dir) / name / "train.log"
        text = (output.unplaced or "") + traceback.format_exc()
        if log.parent.is_dir():
            with open(log, "a") as out:
                out.write(text)
        else:
            print(text, file=sys.stderr, flush=True)
        return 1
    finally:
        signals.uninstall()
    return 0


if __name__ == "__main__":
    sys.exit(main())
