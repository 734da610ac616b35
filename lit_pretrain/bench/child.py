"""Cases timed in a fresh child process, away from the torch and Lightning that `python -m lit_pretrain.bench` has
imported (the data stages run that way in `lit-pretrain prepare`): the child alternates reference and candidate and
prints the series; this process summarizes each with step.paired_case, so they are reported like every other case.

This module imports neither torch nor Lightning at import time: the children import it for `series` (and
bench/stats.py, pure Python, for `alternate`).
"""

import json
import subprocess
import sys
from typing import Dict, List


def series(case: str, refs: List[float], cands: List[float], goal: str, unit: str, names, detail: Dict) -> Dict:
    """A paired case as the child prints it: paired_case's arguments, with the measured series for its callables."""
    return {"case": case, "refs": refs, "cands": cands, "goal": goal, "unit": unit, "names": list(names),
            "detail": detail}


def run(module: str, *args: str, timeout_s: float = 3600) -> List[Dict]:
    """The cases `python -m module args` prints as a JSON list on its last line; a paired series (`series`) goes
    through paired_case, replayed in the order it was measured; any other case is taken as it is."""
    from lit_pretrain.bench.step.step import paired_case

    command = [sys.executable, "-m", module, *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command[:3])} failed:\n{done.stderr[-4000:]}")
    cases = []
    for entry in json.loads(done.stdout.strip().splitlines()[-1]):
        if "refs" in entry:
            refs, cands = entry.pop("refs"), entry.pop("cands")
            entry = paired_case(reference=iter(refs).__next__, candidate=iter(cands).__next__, repeats=len(refs),
                                **entry)
        cases.append(entry)
    return cases
