"""tests/helpers/prewarmed.py: a local rank forked from the run's zygote is the process Lightning's Popen would have
started."""

import json

import pytest

from tests.conftest import ROOT, _prewarmed, launcher_env

pytestmark = pytest.mark.slow  # a run from the prewarmed server (~5 CPU s when this worker has not started it yet)


def test_a_rank_from_the_zygote_has_the_popen_s_argv_env_cwd_session_and_exit_code(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = _prewarmed().run(["tests.helpers.prewarmed_probe", "run", str(tmp_path), str(elsewhere)], launcher_env(),
                            ROOT,
                            120, start_new_session=True)
    assert done.returncode == 0, done.stderr[-3000:]
    run, rank = (json.loads((tmp_path / f"{who}.json").read_text()) for who in ("run", "rank"))
    assert run["popen"] == "RankPopen"  # from the zygote, not a fork-exec
    assert rank["pid"] == run["child"] and rank["ppid"] == run["pid"]  # the run's child: its Popen waited for it
    assert run["code"] == 7  # the rank's exit code, through Popen.wait
    assert rank["sid"] == rank["pgid"] == run["sid"] == run["pid"]  # the run's session and process group
    assert rank["argv"] == ["rank", str(tmp_path)]
    assert rank["cwd"] == rank["path0"] == str(elsewhere)  # `python -m` puts the working directory first
    assert rank["env"] == "rank's" and run["env"] is None
    assert len(set(rank["fds"]) - {0, 1, 2}) <= 1  # 0-2 and listdir's own: close_fds, as Popen's default
    # Ctrl-C: what the run had before it imported anything (Python's handler; "ignored" where pytest was started in
    # the background, which a fresh interpreter inherits too), never the zygote's SIG_IGN.
    assert rank["sigint"] == run["sigint"] and run["sigint"] in ("python", "ignored")
    assert "lit_pretrain.errors" in run["ours_imported"] and rank["ours_imported"] == []  # imports ours anew
