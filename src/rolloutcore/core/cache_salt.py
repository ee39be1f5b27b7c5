"""The version salt of the prefix cache: no request reuses KV computed by another version.

vLLM hashes a request's ``cache_salt`` into the hash of its first KV block,
and every later block's hash chains from the one before, so two requests
with different salts share no prefix-cache block at all. RolloutCore
salts every request by the version it is admitted under: a request under
N+1 can then never hit a block computed under N, whether or not the cache
was reset. That is what makes the asynchronous update modes safe while
requests run (vLLM refuses ``/reset_prefix_cache`` while requests hold
blocks, kept ones included), and it is cheap: requests of one version share
their prefixes exactly as before.

The salt is a pure function of the version (its engine epoch and label,
which name one weight set and are never reused) and, when the client sent
its own ``cache_salt`` (tenant isolation), of that too, so the audit can
recompute it from the record alone. It starts with the label in clear
(``rcv.<label>.<hash>``), so a salt read from a record says which version's
blocks the request could reuse. vLLM accepts up to 128 characters, none of
``@ / \\`` or NUL; labels never contain them.

What the salt does not cover: vLLM's encoder cache (vision embeddings) is
keyed by the image's content, not by the salt, and its multimodal processor
cache holds preprocessed inputs (independent of the weights). The update
path resets both while the engine is paused (``CacheKind.ENCODER``,
``CacheKind.MULTIMODAL``), in every mode.

Standard library only.
"""

from __future__ import annotations

import hashlib
import re

from rolloutcore.core.versions import WeightVersion
from rolloutcore.errors import BadInput

__all__ = ["CACHE_SALT_FIELD", "SALT_PREFIX", "salt_for", "salt_label"]

#: The request field vLLM reads (``/v1/completions``, ``/v1/chat/completions``,
#: ``/inference/v1/generate``; top level of the body, 0.26 and 0.32 alike).
CACHE_SALT_FIELD = "cache_salt"
SALT_PREFIX = "rcv."
_MAX_LABEL_IN_SALT = 80  # 4 + 80 + 1 + 32 = 117 <= vLLM's 128
_SALT_RE = re.compile(r"^rcv\.([A-Za-z0-9][A-Za-z0-9._:-]*)\.([0-9a-f]{32})$")
_FORBIDDEN = frozenset("@/\\\x00")


def salt_for(version: WeightVersion, client_salt: str | None = None) -> str:
    """The ``cache_salt`` of a request admitted under ``version`` (and the client's own)."""
    if not isinstance(version, WeightVersion):
        raise BadInput("salt_for needs a WeightVersion")
    if client_salt is not None and (not isinstance(client_salt, str) or not client_salt
                                    or len(client_salt) > 1024
                                    or any(c in _FORBIDDEN for c in client_salt)):
        raise BadInput("cache_salt must be a non-empty string of at most 1024 characters "
                       "without '@', '/', '\\\\' or NUL")
    h = hashlib.sha256("\x00".join((version.engine_epoch, version.label, client_salt or ""))
                       .encode()).hexdigest()[:32]
    return f"{SALT_PREFIX}{version.label[:_MAX_LABEL_IN_SALT]}.{h}"


def salt_label(salt: str) -> str | None:
    """The (possibly truncated) label a RolloutCore salt names; ``None`` if it is not one."""
    m = _SALT_RE.fullmatch(salt) if isinstance(salt, str) else None
    return m.group(1) if m else None
