"""Session fixtures for tests that run a real vLLM server.

``tiny_models``: checkpoints A (seed 1), B (seed 2) and B_neg (A with decoder
layer 0 negated), made once per session, offline.

``engine_factory``: starts ``ManagedEngine``s and guarantees every one of them
is stopped (whole process group) at session end, whatever happened. Starting
one costs 35-70 s of a 2-core machine and about 2.9 GiB, so the factory keeps
at most ``MAX_ALIVE`` alive at once and refuses a start beyond that (stop one
first), and ``shared(key, ...)`` hands every test that asks for the same key
the same server.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from enginetools import EngineFactory, TinyModels
from rolloutcore.testing.models import make_checkpoint

HERE = Path(__file__).parent


def pytest_itemcollected(item: pytest.Item) -> None:
    """Every test here starts a real engine: one whose module forgot the mark gets it
    (the fast lane skips this directory whole, tests/conftest.py)."""
    if HERE in item.path.parents and item.get_closest_marker("engine") is None:
        item.add_marker(pytest.mark.engine)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    root = tmp_path_factory.mktemp("tiny-models")
    a = make_checkpoint(root / "A", 1)
    b = make_checkpoint(root / "B", 2)
    b_neg = make_checkpoint(root / "B_neg", 1, like=a, negate_layer=0)
    return TinyModels(root, a, b, b_neg)


@pytest.fixture(scope="session")
def engine_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineFactory]:
    factory = EngineFactory(tmp_path_factory.mktemp("engine-logs"))
    try:
        yield factory
    finally:
        factory.stop_all()
