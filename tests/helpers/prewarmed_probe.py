"""Run by tests/test_prewarmed.py from the prewarmed server: as the run (`run OUT CWD`), it starts a rank through the
`subprocess.Popen` of Lightning's launcher module, as Lightning starts local ranks, with its own env and cwd; as the
rank (`rank OUT`), it writes what a process started so sees of itself."""

import json
import os
import signal
import sys
from pathlib import Path


def facts() -> dict:
    return {"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "pgid": os.getpgid(0),
            "argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0], "env": os.environ.get("PROBE"),
            "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
            "sigint": {signal.default_int_handler: "python", signal.SIG_IGN: "ignored",
                       signal.SIG_DFL: "default"}.get(signal.getsignal(signal.SIGINT), "other"),
            "ours_imported": sorted(m for m in sys.modules if m.startswith("lit_pretrain"))}


if __name__ == "__main__":
    out = Path(sys.argv[2])
    if sys.argv[1] == "rank":
        (out / "rank.json").write_text(json.dumps(facts()))
        sys.exit(7)
    from lightning.pytorch.strategies.launchers import subprocess_script as launcher

    import lit_pretrain.errors  # noqa: F401  (imported by the run before it starts the rank: not the rank's)

    proc = launcher.subprocess.Popen([sys.executable, "-m", "tests.helpers.prewarmed_probe", "rank", str(out)],
                                     env={**os.environ, "PROBE": "rank's"}, cwd=sys.argv[3])
    code = proc.wait()
    (out / "run.json").write_text(json.dumps({**facts(), "popen": type(proc).__name__, "child": proc.pid,
                                              "code": code}))
