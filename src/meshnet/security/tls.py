"""TLS for every meshnet link (issue #20 item 6): a process serves https with its
certificate and key, and its own calls trust the system's CAs or a mesh's CA file.

A self-signed mesh makes one CA, signs each machine's certificate with it, and gives every
process `--tls-ca mesh-ca.pem`; the addresses nodes register are then `https://`.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from meshnet.config import TlsConfig
from meshnet.errors import ConfigError


def check(tls: TlsConfig) -> None:
    """Refuse half a server setting or a file that is not there (`ConfigError`)."""
    if (tls.cert_file is None) != (tls.key_file is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    for flag, name in (
        ("--tls-cert", tls.cert_file),
        ("--tls-key", tls.key_file),
        ("--tls-ca", tls.ca_file),
    ):
        if name is not None and not Path(name).expanduser().is_file():
            raise ConfigError(f"{flag} {name}: no such file")


def scheme(tls: TlsConfig) -> str:
    """The scheme of this process's own address."""
    return "https" if tls.serves else "http"


def server_options(tls: TlsConfig) -> dict[str, Any]:
    """uvicorn settings for serving https (none for plain http)."""
    if not tls.serves:
        return {}
    return {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}


def client_context(tls: TlsConfig) -> ssl.SSLContext:
    """What this process's calls verify servers with: the CA file, else the system's CAs.
    Plain `http://` calls ignore it."""
    return ssl.create_default_context(cafile=tls.ca_file)
