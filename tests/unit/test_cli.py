"""`bge-triton <command>`: every listed command reaches its module's own parser; unknown ones fail with the list."""
from __future__ import annotations

import subprocess
import sys

import pytest

from bge_triton import cli


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_command_prints_its_own_help(name: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "bge_triton.cli", name, "--help"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage:"), proc.stdout[:300]
    if name in cli.SUBCOMMAND:  # the SDK's CLI got its sub-command put in front
        assert f"bge_triton.client {cli.SUBCOMMAND[name]}" in proc.stdout.splitlines()[0]


def test_unknown_command_lists_the_commands(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'nope'" in err and all(name in err for name in cli.COMMANDS)


def test_no_command_prints_usage_and_fails(capsys: pytest.CaptureFixture) -> None:
    assert cli.main([]) == 2 and "usage: bge-triton" in capsys.readouterr().out
    assert cli.main(["--help"]) == 0
