"""Where keys come from: flags, environment, key files; first-start key generation.

Swarm key precedence: `MESHNET_SWARM_KEY`, then the key file (`--swarm-key-file`, default
`~/.meshnet/swarm.key`). No key is ever taken from the command line, where `ps` shows it to
every user of the machine; key files must be private (mode 0600). A tracker (or a node without a
tracker) creates the file on first start: 32 random bytes as hex, mode 0600.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

from meshnet.errors import ConfigError
from meshnet.security.swarm import MIN_KEY_CHARS

log = logging.getLogger(__name__)
SWARM_KEY_ENV = "MESHNET_SWARM_KEY"
API_KEYS_ENV = "MESHNET_API_KEYS"  # comma-separated


def default_key_file() -> Path:
    return Path.home() / ".meshnet" / "swarm.key"


def create_key_file(path: Path) -> str:
    """Write a new random key to `path` (0600, created exclusively); the key."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = secrets.token_hex(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(key + "\n")
    log.info("created a new swarm key in %s (mode 0600)", path)
    return key


def check_private(path: Path, what: str) -> None:
    """`ConfigError` unless only its owner may read `path` (mode 0600 or stricter)."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror}") from None
    if mode & 0o077:
        raise ConfigError(
            f"{what} {path} is readable by others (mode {mode:o}); run chmod 600 {path}"
        )


def read_key_file(path: Path) -> str:
    check_private(path, "swarm key file")
    key = path.read_text().strip()
    if len(key) < MIN_KEY_CHARS:
        raise ConfigError(f"swarm key file {path} holds fewer than {MIN_KEY_CHARS} characters")
    return key


def resolve_swarm_key(
    key_file: str | None, *, create: bool, env: dict[str, str] | None = None
) -> tuple[str, str]:
    """The swarm key and where it came from, in words; `ConfigError` when there is none."""
    env = dict(os.environ) if env is None else env
    given = env.get(SWARM_KEY_ENV, "").strip()
    if given:
        if len(given) < MIN_KEY_CHARS:
            raise ConfigError(f"a swarm key needs at least {MIN_KEY_CHARS} characters")
        return given, f"from {SWARM_KEY_ENV}"
    path = Path(key_file).expanduser() if key_file else default_key_file()
    if path.exists():
        return read_key_file(path), f"read from {path}"
    if create:
        return create_key_file(path), f"created in {path} (mode 0600)"
    raise ConfigError(
        f"no swarm key: pass --swarm-key, set {SWARM_KEY_ENV}, or copy the tracker's key "
        f"file to {path} (the tracker prints the exact join command when it starts)"
    )


def resolve_api_keys(keys_file: str | None, env: dict[str, str] | None = None) -> tuple[str, ...]:
    """Client API keys from `MESHNET_API_KEYS` (comma-separated) and a private keys file (one
    key per line, `#` comments)."""
    env = dict(os.environ) if env is None else env
    keys = [k.strip() for k in env.get(API_KEYS_ENV, "").split(",")]
    if keys_file:
        path = Path(keys_file).expanduser()
        check_private(path, "API keys file")
        lines = path.read_text().splitlines()
        keys += [line.strip() for line in lines if not line.strip().startswith("#")]
    keys = [k for k in keys if k]
    short = [k for k in keys if len(k) < 8]
    if short:
        raise ConfigError("an API key needs at least 8 characters")
    return tuple(dict.fromkeys(keys))


def join_command(tracker_url: str, key: str) -> str:
    """What a new node runs to join this tracker's mesh."""
    return f"{SWARM_KEY_ENV}={key} meshnet node --tracker {tracker_url}"
