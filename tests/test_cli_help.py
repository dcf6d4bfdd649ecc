"""Finding 5: every option of every command says what it does, and ``run --help`` lists the exit statuses."""

from __future__ import annotations

import click
from click.testing import CliRunner

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


def test_run_help_lists_the_exit_statuses():
    out = " ".join(CliRunner().invoke(main, ["run", "--help"], terminal_width=200).output.split())
    for code, what in OUTCOMES.items():
        assert f"{code} {what}" in out, out
