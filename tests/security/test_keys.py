"""Key sources: precedence, first-start creation with mode 0600, refusals."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from meshnet.errors import ConfigError
from meshnet.security.keys import join_command, resolve_api_keys, resolve_swarm_key


def test_a_tracker_creates_a_private_key_file_once(tmp_path: Path) -> None:
    path = tmp_path / "dir" / "swarm.key"
    key, origin = resolve_swarm_key(None, str(path), create=True, env={})
    assert "created" in origin and len(key) == 64
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again, origin = resolve_swarm_key(None, str(path), create=True, env={})
    assert again == key and "read from" in origin


def test_flag_beats_environment_beats_file(tmp_path: Path) -> None:
    path = tmp_path / "swarm.key"
    resolve_swarm_key(None, str(path), create=True, env={})
    env = {"MESHNET_SWARM_KEY": "from-the-environment"}
    assert resolve_swarm_key("from-the-flag-1234", str(path), create=False, env=env)[0] == (
        "from-the-flag-1234"
    )
    assert resolve_swarm_key(None, str(path), create=False, env=env)[0] == "from-the-environment"


def test_refusals(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no swarm key"):
        resolve_swarm_key(None, str(tmp_path / "missing"), create=False, env={})
    with pytest.raises(ConfigError, match="at least"):
        resolve_swarm_key("short", None, create=False, env={})
    shared = tmp_path / "shared.key"
    shared.write_text("x" * 64)
    shared.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        resolve_swarm_key(None, str(shared), create=False, env={})


def test_api_keys_from_flags_environment_and_file(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# clients\nfile-key-0001\n\n")
    env = {"MESHNET_API_KEYS": "env-key-0001,env-key-0002"}
    keys = resolve_api_keys(["flag-key-0001"], str(keys_file), env=env)
    assert keys == ("flag-key-0001", "env-key-0001", "env-key-0002", "file-key-0001")
    with pytest.raises(ConfigError):
        resolve_api_keys(["short"], None, env={})


def test_the_join_command_carries_the_key_in_the_environment() -> None:
    assert join_command("http://h:8000", "k" * 20) == (
        f"MESHNET_SWARM_KEY={'k' * 20} meshnet node --tracker http://h:8000"
    )
