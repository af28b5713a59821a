"""Key sources: precedence, first-start creation with mode 0600, refusals."""

from __future__ import annotations

import argparse
import stat
from pathlib import Path

import pytest

from meshnet.cli import main
from meshnet.cli.serve import announce_tracker
from meshnet.errors import ConfigError
from meshnet.security.keys import join_command, resolve_api_keys, resolve_swarm_key


def test_a_tracker_creates_a_private_key_file_once(tmp_path: Path) -> None:
    path = tmp_path / "dir" / "swarm.key"
    key, origin = resolve_swarm_key(str(path), create=True, env={})
    assert "created" in origin and len(key) == 64
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again, origin = resolve_swarm_key(str(path), create=True, env={})
    assert again == key and "read from" in origin


def test_environment_beats_file(tmp_path: Path) -> None:
    path = tmp_path / "swarm.key"
    resolve_swarm_key(str(path), create=True, env={})
    env = {"MESHNET_SWARM_KEY": "from-the-environment-0123456789abcdef"}
    assert resolve_swarm_key(str(path), create=False, env=env)[0] == env["MESHNET_SWARM_KEY"]


def test_refusals(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no swarm key"):
        resolve_swarm_key(str(tmp_path / "missing"), create=False, env={})
    with pytest.raises(ConfigError, match="at least"):
        resolve_swarm_key(None, create=False, env={"MESHNET_SWARM_KEY": "x" * 31})  # < 128 bits
    shared = tmp_path / "shared.key"
    shared.write_text("x" * 64)
    shared.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        resolve_swarm_key(str(shared), create=False, env={})


def test_api_keys_from_environment_and_a_private_file(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# clients\nfile-key-0001\n\n")
    keys_file.chmod(0o600)
    env = {"MESHNET_API_KEYS": "env-key-0001,env-key-0002"}
    keys = resolve_api_keys(str(keys_file), env=env)
    assert keys == ("env-key-0001", "env-key-0002", "file-key-0001")
    with pytest.raises(ConfigError):
        resolve_api_keys(None, env={"MESHNET_API_KEYS": "short"})
    keys_file.chmod(0o644)  # review finding 12: the keys file's mode was never checked
    with pytest.raises(ConfigError, match="chmod 600"):
        resolve_api_keys(str(keys_file), env={})


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["node", "--swarm-key", "k" * 64], "MESHNET_SWARM_KEY"),
        (["tracker", "--api-key", "client-key-0001"], "MESHNET_API_KEYS"),
        (["generate", "--api-key", "client-key-0001", "hi"], "MESHNET_API_KEY"),
    ],
)
def test_secrets_on_the_command_line_are_refused(
    argv: list[str], hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review finding 12: `ps` shows every user of the machine a process's argv."""
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert refused.value.code == 2
    assert hint in capsys.readouterr().err


def test_the_join_command_carries_the_key_in_the_environment() -> None:
    assert join_command("http://h:8000", "k" * 20) == (
        f"MESHNET_SWARM_KEY={'k' * 20} meshnet node --tracker http://h:8000"
    )


def test_the_tracker_prints_the_key_only_when_it_created_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = argparse.Namespace(host="127.0.0.1", port=8000, tls_cert=None)
    announce_tracker(args, "k" * 64, "created in /x/swarm.key (mode 0600)")
    assert "k" * 64 in capsys.readouterr().out
    announce_tracker(args, "k" * 64, "read from /x/swarm.key")
    out = capsys.readouterr().out
    assert "k" * 64 not in out and "<the key read from /x/swarm.key>" in out
    args.peers, args.public_address = ("http://b:8000",), "http://a:8000"  # several trackers
    announce_tracker(args, "k" * 64, "read from /x/swarm.key")
    assert "meshnet node --tracker http://a:8000,http://b:8000" in capsys.readouterr().out
