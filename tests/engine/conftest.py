"""Session fixtures for tests that run a real vLLM server.

``tiny_models``: checkpoints A (seed 1), B (seed 2) and B_neg (A with decoder
layer 0 negated), made once per session, offline.

``engine_factory``: starts ``ManagedEngine``s and guarantees every one of them
is stopped (whole process group) at session end, whatever happened. Starting
one costs 35-70 s of a 2-core machine and about 2.9 GiB, so the factory keeps
at most ``MAX_ALIVE`` alive at once and refuses a start beyond that (stop one
first), and ``shared(key, ...)`` hands every test that asks for the same key
the same server.

The launch helpers the native-routes and fleet modules share: ``cold_greedy`` (what a
cold engine computes), ``native_gateway`` (``serve --upstream --native-routes`` in front
of a started engine) and ``serve_engines`` (``serve`` launching its own engines, as a
user runs it).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from fleettools_engine import greedy

from enginetools import (
    EngineFactory,
    Greedy,
    NativeGateway,
    ServeEngines,
    TinyModels,
    gateway_process,
    spawn_serve,
    stop_group,
    wait_healthy,
)
from rolloutcore.engine.process import ManagedEngine
from rolloutcore.testing.models import make_checkpoint

HERE = Path(__file__).parent


def pytest_itemcollected(item: pytest.Item) -> None:
    """Every test here starts a real engine: one whose module forgot the mark gets it
    (the fast lane skips this directory whole, tests/conftest.py)."""
    if HERE in item.path.parents and item.get_closest_marker("engine") is None:
        item.add_marker(pytest.mark.engine)


@pytest.fixture(scope="session", autouse=True)
def _compile_without_aot() -> Iterator[None]:
    """Every engine started here (``ManagedEngine``, ``rolloutcore serve``) compiles
    without vLLM's AOT artifact (``VLLM_USE_AOT_COMPILE=0``; a value set outside is kept).

    vLLM 0.32's CPU build saves that artifact at every start and fails to load it at
    the next ("'function' object has no attribute 'finalize_loading'"), so each start
    compiled again and paid the save too. Without it the model is compiled the same way
    (dynamo, inductor) and inductor's own cache serves the later starts: warm-up 7-12 s
    instead of 15-29 s on the 2-core machine (CHANGELOG).
    """
    with pytest.MonkeyPatch.context() as mp:
        if "VLLM_USE_AOT_COMPILE" not in os.environ:
            mp.setenv("VLLM_USE_AOT_COMPILE", "0")
        yield


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


@pytest.fixture(scope="session")
def cold_greedy(engine_factory: EngineFactory) -> Callable[..., Greedy]:
    """``cold_greedy(model_dir, **kwargs)``: the greedy ids and logprobs
    (``fleettools_engine.greedy``) of an engine cold-started on ``model_dir`` with no
    transfer backend (``kwargs`` go to ``ManagedEngine``), stopped once it has answered."""

    def run(model_dir: Path, **kwargs: Any) -> Greedy:
        eng = engine_factory(model_dir, backend=None, **kwargs)
        try:
            return greedy(eng.base_url)
        finally:
            engine_factory.stop(eng)

    return run


@pytest.fixture(scope="session")
def native_gateway() -> NativeGateway:
    """``native_gateway(engine, checkpoint, work, token, native, extra=())``: ``rolloutcore
    serve --upstream <engine> --native-routes --min-verification declared`` (and
    ``extra``), its control token ``token`` in ``work/token``, the trainer's path token
    ``native`` (``/rc/<native>``), its log ``work/gateway.log``. A context manager: the
    gateway's URL once it answers; the gateway is stopped on exit."""

    @contextlib.contextmanager
    def run(engine: ManagedEngine, checkpoint: Path, work: Path, token: str, native: str,
            extra: Sequence[str] = ()) -> Iterator[str]:
        token_file = work / "token"
        token_file.write_text(token + "\n")
        with gateway_process(engine.base_url, checkpoint, token_file, work / "gateway.log",
                             ["--native-routes", "--min-verification", "declared", *extra],
                             env={"ROLLOUTCORE_NATIVE_TOKEN": native}) as (url, _proc):
            yield url

    return run


@pytest.fixture(scope="session")
def serve_engines() -> ServeEngines:
    """``serve_engines(args, log, env={}, timeout_s=900)``: ``python -m rolloutcore serve
    --port <free> *args`` in its own process group (``env`` added to this process's),
    as a user runs it. A context manager: (its URL, the process) once ``/health`` is 200;
    on exit the group gets SIGTERM (SIGKILL after 120 s) and is waited for."""

    @contextlib.contextmanager
    def run(args: Sequence[str], log: Path, env: Mapping[str, str] | None = None,
            timeout_s: float = 900) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
        url, proc = spawn_serve(args, log, env)
        try:
            wait_healthy(url, proc, log, timeout_s)
            yield url, proc
        finally:
            stop_group(proc, 120)

    return run
