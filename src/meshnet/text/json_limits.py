"""Limits on the JSON schemas a request may bring (`response_format`, tools' parameters):
checked before anything is compiled, so a huge or deep schema costs nothing (ADR-0043)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from meshnet.errors import RequestError

MAX_SCHEMA_BYTES = 32_768  # a schema's JSON text, at most
MAX_SCHEMA_DEPTH = 16  # nested objects/arrays in a schema, at most
# llguidance's JSON without free whitespace: a small model cannot pad an answer with blanks
COMPACT = {"x-guidance": {"whitespace_flexible": False}}


def check_schema(schema: Mapping[str, Any], field: str) -> str:
    """The schema as JSON text; a 400 naming `field` when it is too large or too deep."""
    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_BYTES:
        raise RequestError(
            f"the JSON schema is {len(text)} bytes; at most {MAX_SCHEMA_BYTES} are taken",
            field=field,
        )
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise RequestError(
            f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels", field=field
        )
    return text


def _depth(value: object) -> int:
    if isinstance(value, Mapping):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0
