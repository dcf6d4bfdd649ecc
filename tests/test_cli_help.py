"""Finding 5: every option of every command says what it does, and ``run --help`` lists the exit statuses; an
option ``run`` does not have is refused before anything starts (issue 24, item 1)."""

from __future__ import annotations

import os
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from helpers import cli, local_conf, make_workspace

from paddle_cluster.cli import main
from paddle_cluster.launch.errors import OUTCOMES


def _commands(group: click.Group, prefix: str = ""):
    for name, cmd in group.commands.items():
        yield f"{prefix}{name}", cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, f"{prefix}{name} ")


def test_every_option_has_help_text():
    missing = [f"{where or 'paddle-cluster'} {p.opts[0]}" for where, cmd in [("", main), *_commands(main)]
               for p in cmd.params if isinstance(p, click.Option) and not p.help and p.name != "version"]
    assert not missing, f"options without help: {missing}"


def test_no_help_text_shows_an_unset_bound():
    """An integer option with no lower bound said ``[x<=None]`` (run --run-as-user, --ttl)."""
    shown = {where or "paddle-cluster": CliRunner().invoke(main, [*where.split(), "--help"], terminal_width=200).output
             for where, _ in [("", main), *_commands(main)]}
    assert not [w for w, out in shown.items() if "None]" in out], [w for w, out in shown.items() if "None]" in out]


def test_run_help_lists_the_exit_statuses():
    out = " ".join(CliRunner().invoke(main, ["run", "--help"], terminal_width=200).output.split())
    for code, what in OUTCOMES.items():
        assert f"{code} {what}" in out, out


# -- item 1 of issue 24: an option run does not have is never handed to the entry script -------------------
@pytest.mark.parametrize("typed, meant", [
    (["--max_restart", "1"], "--max_restarts"),
    (["--max_restart=1"], "--max_restarts"),
    (["--job-name", "x"], "--job_name"),
    (["--jobname", "x"], "--job_name"),
    (["--Job_Name", "x"], "--job_name"),
    (["--num_passes", "10"], None),  # a v2 option of the script: it belongs after --
    (["--colective"], "--collective"),
])
def test_unknown_run_option_is_refused_with_the_closest_one(tmp_path, typed, meant):
    ws = make_workspace(tmp_path / "ws")
    conf = local_conf(tmp_path)
    res = cli(conf, "run", *typed, "--job_dispatch_package", str(ws), env=_home(tmp_path))
    assert res.returncode == 2, res.stdout + res.stderr
    option = typed[0].split("=")[0]
    hint = f" (did you mean {meant}?)" if meant else ""
    assert (f"Error: run has no option {option}{hint}; nothing was started. The entry script's own arguments go "
            f"after --: paddle-cluster run [OPTIONS] -- {' '.join(typed)}") in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "root").exists(), "nothing may start: not even ROOT_DIR is made"


@pytest.mark.parametrize("typed, named", [
    (["--pserver", "builtin"], "--pserver builtin"),
    (["--resume_from", "JOB1"], "--resume_from JOB1"),
    (["--elastic"], "--elastic"),
])
def test_a_collective_job_refuses_a_pserver_option_in_one_line(tmp_path, typed, named):
    ws = make_workspace(tmp_path / "ws")
    res = cli(local_conf(tmp_path), "run", "--collective", *typed, "--job_dispatch_package", str(ws),
              env=_home(tmp_path))
    assert res.returncode == 2 and res.stderr.startswith(f"paddle-cluster: error: {named}"), res.stderr
    assert "this job has no pservers (--collective)" in res.stderr and len(res.stderr.splitlines()) == 1, res.stderr
    assert not (tmp_path / "root").exists(), "nothing may start: not even ROOT_DIR is made"
    journals = list((tmp_path / "state").rglob("*.json"))
    assert not [j for j in journals if "JOB" in j.read_text()], "a refused job keeps no job name as taken"


def test_render_k8s_refuses_unknown_options_too(tmp_path):
    res = cli(local_conf(tmp_path), "render", "k8s", "--image", "img:1", "--namspace", "ml", env=_home(tmp_path))
    assert res.returncode == 2 and "render k8s has no option --namspace (did you mean --namespace?)" in res.stderr
    ok = cli(local_conf(tmp_path), "render", "k8s", "--image", "img:1", "--", "--namspace", "ml",
             env=_home(tmp_path))
    assert ok.returncode == 0, ok.stderr
    assert '"--namspace"' in ok.stdout or "- --namspace" in ok.stdout, ok.stdout  # the script's argument now


def test_script_arguments_after_double_dash_reach_the_script(tmp_path):
    """The fix the error names works: the same tokens after -- reach every trainer, and run's own options before
    -- still count (--job_name)."""
    ws = make_workspace(tmp_path / "ws")
    # PSERVER_COMMAND: make_workspace's ps.py only listens; its train.py prints its arguments and never connects.
    conf = local_conf(tmp_path, ENV={"MY_SETTING": "42"}, PSERVER_COMMAND="{python} ps.py", TRAINERS_PER_NODE=2,
                      LD_LIBRARY_PATH="/extra/lib")
    res = cli(conf, "run", "--job_dispatch_package", str(ws), "--job_name", "argsjob", "--", "--max_restart", "1",
              "--job-name", "x", env=_home(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    for t in (0, 1):
        assert f"ENV OK trainer {t} of 2 on node 0 args ['--max_restart', '1', '--job-name', 'x']" in res.stdout
    assert (tmp_path / "root" / "argsjob").is_dir()


def test_run_help_says_where_script_arguments_go():
    out = CliRunner().invoke(main, ["run", "--help"], terminal_width=200).output
    assert "Usage: main run [OPTIONS] [-- SCRIPT_ARGS...]" in out or "run [OPTIONS] [-- SCRIPT_ARGS...]" in out, out
    text = " ".join(out.split())
    assert "The arguments after -- reach the entry script" in text
    assert "a misspelt one is refused (with the closest one) and nothing starts" in text


def _home(tmp: Path) -> dict:
    """A scratch HOME and state directory: the launcher's caches and journal stay in the test's directory."""
    return dict(os.environ, HOME=str(tmp), XDG_STATE_HOME=str(tmp / "state"), XDG_CACHE_HOME=str(tmp / "cache"))


def test_paddle_cluster_options_after_the_command_are_named_as_such(tmp_path):
    """``run --conf FILE`` is a common slip: say that --conf goes before the command, not that it is unknown."""
    conf = local_conf(tmp_path)
    res = cli(conf, "run", "--conf", str(conf), "--job_dispatch_package", str(make_workspace(tmp_path / "ws")),
              env=_home(tmp_path))
    assert res.returncode == 2
    assert (f"Error: --conf is an option of paddle-cluster itself, not of run; nothing was started. Give it before "
            f"the command: paddle-cluster --conf {conf} run ...") in res.stderr, res.stderr
    assert not (tmp_path / "root").exists()
