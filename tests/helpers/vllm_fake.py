"""The one fake of vLLM (``rolloutcore.testing.FakeVllm``) as the unit tests of the
engine client set it up: a fresh ``FakeEngine`` (no token delay), the model ``policy``,
the label ``rc-1``, the routes a test's vLLM serves, and the answers it needs that the
engine's state never gives (``FakeVllm.override``). A test that needs vLLM's routes
builds this, never a handler of its own (``tests/test_layering_fakes.py``, ``fakes_of_vllm``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import httpx

from rolloutcore.engine.routes import Routes
from rolloutcore.testing import FakeVllm
from rolloutcore.testing.fake_engine import FakeEngine, FakeWeights

Handler = Callable[[httpx.Request], httpx.Response]


def vllm(*, version: str = "fake", only: Iterable[str] | None = None,
         without: Iterable[str] = (), overrides: Mapping[str, Handler] | None = None,
         seen: list[httpx.Request] | None = None) -> FakeVllm:
    """A ``FakeVllm`` saying it is ``version``, serving ``only`` those of its routes (with
    ``/openapi.json``; ``None``: all) less ``without``, each path of ``overrides``
    answered by its handler; ``seen`` gets every request it is sent, in order."""
    def fresh(gone: Iterable[str] = ()) -> FakeVllm:
        return FakeVllm(FakeEngine(FakeWeights.from_seed(0), token_delay_s=0.0),
                        model="policy", without=gone)

    gone = set(without)
    if only is not None:
        gone |= fresh().paths - set(only) - {Routes.OPENAPI}
    fake = fresh(gone)
    fake.engine.label, fake.version = "rc-1", version
    for path, handler in (overrides or {}).items():
        fake.override(path, handler)
    if seen is not None:
        fake.before = seen.append
    return fake


def answer(status: int, body: object = None, text: str | None = None) -> Handler:
    """A handler answering ``status`` with the JSON ``body`` (or ``text``, or nothing)."""
    def h(_: httpx.Request) -> httpx.Response:
        if text is not None:
            return httpx.Response(status, text=text)
        return httpx.Response(status, json=body) if body is not None else httpx.Response(status)
    return h


def sent(fake: FakeVllm, path: str) -> int:
    """How many requests ``fake`` was sent to ``path``."""
    return sum(1 for _, p in fake.received if p == path)
