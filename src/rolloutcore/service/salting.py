"""The gateway's version salt: every admitted request's prefix cache salted by its version.

vLLM reads ``cache_salt`` at the top level of the three data routes'
bodies (``/v1/completions``, ``/v1/chat/completions``,
``/inference/v1/generate``; 0.26 and 0.32) and hashes it into the request's
first KV block, so requests with different salts share no block. The
gateway sets it to ``core.cache_salt.salt_for(binding.version)`` after
admission: a request admitted under N+1 can never reuse a block computed
under N, even where the prefix cache could not be reset (vLLM refuses the
reset while requests hold blocks). A client's own ``cache_salt`` (tenant
isolation) is kept, folded into the version salt.

The body is spliced, not re-serialized, when the client sent no salt: the
gateway's own path is its cost (``docs/service.md``).
"""

from __future__ import annotations

import json
from typing import Any

from rolloutcore.core.cache_salt import CACHE_SALT_FIELD, salt_for
from rolloutcore.core.versions import Binding
from rolloutcore.errors import BadInput

__all__ = ["check_client_salt", "salted_body"]

_FORBIDDEN = frozenset("@/\\\x00")


def check_client_salt(payload: dict[str, Any]) -> str:
    """The problem with a client's ``cache_salt`` ("" if none), checked before admission."""
    v = payload.get(CACHE_SALT_FIELD)
    if v is None:
        return ""
    if not isinstance(v, str) or not v or len(v) > 1024 or any(c in _FORBIDDEN for c in v):
        return ("'cache_salt' must be a non-empty string of at most 1024 characters without "
                "'@', '/', '\\\\' or NUL")
    return ""


def salted_body(raw: bytes, payload: dict[str, Any], binding: Binding) -> tuple[bytes, str]:
    """``raw`` with the version salt of ``binding`` (and the client's), and that salt."""
    client = payload.get(CACHE_SALT_FIELD)
    if client is not None and not isinstance(client, str):
        raise BadInput("cache_salt must be a string")
    salt = salt_for(binding.version, client)
    if client is None:
        body = raw.strip()
        if len(body) >= 2 and body[:1] == b"{" and body[-1:] == b"}":
            head = body[:-1].rstrip()
            sep = b"" if head == b"{" else b","
            return head + sep + b'"cache_salt":' + json.dumps(salt).encode() + b"}", salt
    out = dict(payload)
    out[CACHE_SALT_FIELD] = salt
    return json.dumps(out, separators=(",", ":")).encode(), salt
