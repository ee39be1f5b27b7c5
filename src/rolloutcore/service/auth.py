"""Bearer tokens: generated or given, compared in constant time.

The control endpoints can change which weights every client is served, so
they always need a token. The token is never logged by the service itself;
``rolloutcore serve`` prints a generated one once, to the operator's console.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from pathlib import Path

from rolloutcore.errors import BadInput

__all__ = ["AuthResult", "check_bearer", "generate_token", "read_token_file"]


def generate_token() -> str:
    """256 bits from the OS's CSPRNG, URL-safe."""
    return secrets.token_urlsafe(32)


def read_token_file(path: str | Path) -> str:
    """A token kept in a file (first line), so it stays out of ``ps`` and shell history."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise BadInput(f"cannot read token file {path}: {exc}") from exc
    lines = text.strip().splitlines()
    tok = lines[0].strip() if lines else ""
    if not tok:
        raise BadInput(f"token file {path} is empty")
    return tok


class AuthResult:
    """Why a request was let in or not: ``None`` status means allowed."""

    __slots__ = ("reason", "status")

    def __init__(self, status: int | None, reason: str = "") -> None:
        self.status = status
        self.reason = reason

    @property
    def ok(self) -> bool:
        return self.status is None


_OK = AuthResult(None)


def check_bearer(authorization: bytes | str | None, expected: str | None) -> AuthResult:
    """Check an ``Authorization`` header value against ``expected`` (``None``: open).

    401 when no bearer credentials were sent, 403 when they are wrong.
    """
    if expected is None:
        return _OK
    if authorization is None:
        return AuthResult(401, "missing bearer token")
    if isinstance(authorization, bytes):
        try:
            authorization = authorization.decode("latin-1")
        except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes any byte
            return AuthResult(401, "malformed Authorization header")
    scheme, _, cred = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not cred.strip():
        return AuthResult(401, "Authorization must be 'Bearer <token>'")
    if not hmac.compare_digest(cred.strip().encode("utf-8", "replace"),
                               expected.encode("utf-8")):
        return AuthResult(403, "invalid token")
    return _OK


def write_token_file(path: str | os.PathLike[str], token: str) -> None:
    """Write ``token`` to ``path``, readable by its owner only, never through a link.

    ``O_NOFOLLOW`` refuses a symbolic link at ``path`` (a link planted there
    would send the control token wherever it points); an existing file is
    truncated and set to 0600 before anything is written to it.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise BadInput(f"cannot write the token to {path} (a symbolic link is refused): "
                       f"{exc}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BadInput(f"{path} is not a regular file")
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as fh:
            fd = -1
            fh.write(token + "\n")
    finally:
        if fd >= 0:
            os.close(fd)
