import atexit
import gc
import itertools
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Shared test helpers (coretools, helpers/) are imported as plain modules.
sys.path.insert(0, str(Path(__file__).parent))

from helpers.schedule import HEAVIEST_FIRST, HF_UNIT, hf_unit

ENGINE_DIR = Path(__file__).parent / "engine"

# Under xdist each worker's torch would take one thread per core: two workers on a
# 2-core host run 4 spinning threads on 2 cores (a core kept busy beside them made a
# 0.7 s test take 10 s). Each worker gets its share of the cores instead, unless the
# environment says otherwise. Set before torch is imported (it reads it then).
if os.environ.get("PYTEST_XDIST_WORKER"):
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, len(os.sched_getaffinity(0)) // max(1, _workers))))


def _share_default_tls_contexts() -> None:
    """Every httpx client left at the default ``verify`` makes a verifying TLS context,
    reading the CA bundle (10-30 ms). src's clients pass ``engine.errors.tls_context()``
    (one per process); this is for the tests' own (``httpx.get``/``post``/``stream``,
    ``httpx.Client`` against a loopback server: ~45 sites, 159 contexts and 2.2 s in nine
    of their files without it, at load 6). Those share one per environment that picks
    the bundle; any other ``verify`` is made as httpx makes it."""
    try:
        import httpx._config as config
        import httpx._transports.default as transports
    except ImportError:
        return
    real = config.create_ssl_context
    if getattr(transports, "create_ssl_context", None) is not real:
        return  # not the httpx this was written for: leave it alone
    made: dict[tuple[Any, ...], Any] = {}

    def create_ssl_context(verify: Any = True, cert: Any = None, trust_env: bool = True) -> Any:
        if verify is not True or cert is not None:
            return real(verify=verify, cert=cert, trust_env=trust_env)
        key = (trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        if key not in made:
            made[key] = real(verify=verify, cert=cert, trust_env=trust_env)
        return made[key]

    transports.create_ssl_context = create_ssl_context


_share_default_tls_contexts()


def _interruptible_like_a_terminal() -> None:
    """A test run started in the background (``cmd &`` in a script: SIGINT ignored) or
    under ``nohup`` (SIGHUP ignored) hands those dispositions to every process it starts,
    and Python installs no KeyboardInterrupt handler where SIGINT is ignored at start.
    The Ctrl-C, SIGTERM and SIGHUP tests (ours and their child processes) then see
    nothing. The run is made to behave as one started from a terminal: SIGINT raises
    KeyboardInterrupt here, and a hangup is absorbed by a handler of this process only
    (a handler, unlike an ignore, is reset to the default in every child it execs)."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
        signal.signal(signal.SIGHUP, lambda signum, frame: None)


_interruptible_like_a_terminal()


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch thread for a module whose replicas or managers compute in this process
    (two at once would oversubscribe a 2-core host: minutes instead of seconds); the
    process's count is put back after the module, so no later file computes otherwise."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _signal_dispositions_per_test() -> Any:
    """Each test starts interruptible (above) and leaves SIGINT, SIGTERM and SIGHUP as it
    found them: a test or an import that ignores or replaces one (a server run in the
    main thread, an engine's import) must not make every later test's Ctrl-C a no-op."""
    import signal

    _interruptible_like_a_terminal()
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = {s: signal.getsignal(s) for s in sigs}
    yield
    for s, handler in before.items():
        if signal.getsignal(s) is not handler and handler is not None:
            signal.signal(s, handler)

# Collection imports torch, transformers, PEFT, schemathesis and the package: about a
# million objects that live as long as the process, which the cyclic collector walked
# again on every full collection (a dozen during collection, ~1 s each on a busy host,
# and more during the run). Collection runs with the collector off; once it is done one
# full collection frees what it left and gc.freeze() moves the survivors out of the
# collector's generations. Objects made afterwards (by the tests) are collected as always.
_GC_WAS_ENABLED = gc.isenabled()
gc.disable()


def pytest_collection_finish(session: pytest.Session) -> None:
    if _GC_WAS_ENABLED and not gc.isenabled():
        gc.collect()
        gc.freeze()
        gc.enable()


# Unfrozen at exit, not in pytest_unconfigure: pytest's unraisable-exception plugin runs a
# full collection in its unconfigure and another in its cleanup (to flush finalizers of
# the tests' objects), and unfrozen first, those walked the million collected objects
# again in every process at its end. atexit runs after both and before shutdown, which
# finalizes them as it would have (extension modules check).
atexit.register(gc.unfreeze)


# An xdist worker's interpreter shutdown, once its session is over and every report is with
# the controller: full collections of the million objects collection imported (several,
# as the modules are torn down) and torch's C++ teardown, 6-10 s of the fast lane's end at
# load 4 (the controller waits for both workers to exit, up to xdist's 10 s timeout).
# Nothing of the run is decided there: a worker process ends at once instead, after the
# atexit handlers registered after this one have run (LIFO: tmp_path's numbered-dir cleanup,
# multiprocessing's children, weakref finalizers such as TemporaryDirectory's, torch's) and
# logging and the standard streams are flushed. Only the worker process itself: not a child
# it forked, nor a process it started that loads this conftest (it inherits
# PYTEST_XDIST_WORKER but has no ``workerinput``), whose exit status a test may read.
def _exit_without_teardown(pid: int) -> None:
    if os.getpid() != pid or "coverage" in sys.modules:
        return  # not the worker; or a coverage run, whose data may be saved at exit
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


def _unicode_tables_for_the_workers() -> None:
    """Hypothesis's tables of which characters utf-8 encodes and of the Unicode categories
    (schemathesis draws its strings through them at collection), computed once here in
    xdist's controller while the workers start. A fresh clone has no ``.hypothesis/``,
    where Hypothesis caches them, and each worker computed them itself (a loop over every
    code point: ~1.5 s of CPU each). Hypothesis writes the cache atomically; a worker that
    gets there first computes them as before."""
    try:
        from hypothesis.internal.charmap import charmap, intervals_from_codec

        intervals_from_codec("utf-8")
        charmap()
    except Exception:  # an optimisation only: the workers compute them as before
        pass


def _rewrite_this_workers_share(config: pytest.Config) -> None:
    """Every worker imports every test module at collection, and on a fresh clone each
    rewrote the asserts of all of them (``tests/test_*.py``: ~3.2 s of CPU per worker)
    before caching the result in ``__pycache__``, both at once. Before collecting, worker
    i of n rewrites and caches every n-th module from the i-th, as pytest's import hook
    does (its functions; the pyc it reads back is checked against the source as
    always), so that each worker finds the other's share cached. Any change in those
    functions leaves the hook to do it all, as before."""
    if sys.dont_write_bytecode:
        return
    try:
        from _pytest.assertion.rewrite import (
            PYC_TAIL,
            _read_pyc,
            _rewrite_test,
            _write_pyc,
            assertstate_key,
            get_cache_dir,
            try_makedirs,
        )

        state = config.stash[assertstate_key]
        n = int(config.workerinput["workercount"])  # type: ignore[attr-defined]
        i = int(str(config.workerinput["workerid"]).removeprefix("gw"))  # type: ignore[attr-defined]
        if n < 2 or config.getoption("assertmode", "rewrite") != "rewrite":
            return
        for fn in sorted((Path(config.rootpath) / "tests").glob("test_*.py"))[i::n]:
            cache_dir = get_cache_dir(fn)
            pyc = cache_dir / (fn.name[:-3] + PYC_TAIL)
            if _read_pyc(fn, pyc, state.trace) is None and try_makedirs(cache_dir):
                source_hash, co = _rewrite_test(fn, config)
                _write_pyc(state, co, source_hash, pyc)
    except Exception:  # an optimisation only: the import hook rewrites what is left
        return


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        atexit.register(_exit_without_teardown, os.getpid())


# After Hypothesis's own sessionstart: before it, it refuses (a warning, an error here)
# storage access as slow plugin initialization.
@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    if hasattr(config, "workerinput"):
        _rewrite_this_workers_share(config)
    elif (config.getoption("numprocesses", None) or 0) \
            and not config.getoption("collectonly", False):
        import threading

        threading.Thread(target=_unicode_tables_for_the_workers, daemon=True,
                         name="hypothesis-unicode-tables").start()


def rejects_every_engine_test(markexpr: str) -> bool:
    """Whether the ``-m`` expression deselects every test that carries the ``engine``
    mark, whatever its other marks: true for ``not engine and not gpu and not slow``
    (the fast lane), false for ``""``, ``engine``, ``slow and not gpu``."""
    if not markexpr.strip() or "(" in markexpr:
        return False  # no expression; keyword arguments: not worth deciding here
    from _pytest.mark.expression import Expression

    expr = Expression.compile(markexpr)
    names = sorted(set(re.findall(r"[\w.:+\-\[\]\\/]+", markexpr))
                   - {"and", "or", "not", "engine"})
    if len(names) > 10:
        return False
    for values in itertools.product((False, True), repeat=len(names)):
        marks = {"engine": True, **dict(zip(names, values, strict=True))}
        if expr.evaluate(lambda name, /, marks=marks, **kw: marks.get(name, False)):
            return False
    return True


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    # Every test under engine/ carries the engine mark (engine/conftest.py adds it
    # to any that lacks it), so a lane that deselects them all need not import
    # those modules: they pull vLLM, torch and transformers in at import, seconds
    # of every worker's collection.
    if collection_path == ENGINE_DIR and rejects_every_engine_test(
            config.getoption("markexpr", "") or ""):
        return True
    return None


# The fast lane's schedule (``-n 2 --dist loadfile``). xdist hands out whole files, the
# ones with the most tests first, so the heaviest files (one or a few tests each) came
# last and one worker ran them while the other had finished. Files are handed out
# heaviest first instead (test-phase CPU of one worker, measured on the fast lane), the
# rest as xdist orders them. The files that compute through Hugging Face's stack (PEFT,
# transformers, TRL, the tiny checkpoints: ``helpers.schedule``) are one unit, run by one worker:
# that stack is imported by one process instead of two (``import peft`` brings
# transformers and accelerate: ~4 s of CPU), and the PEFT fake's per-process caches
# (base models, merged adapters, answers) serve every such file. Their modules skip
# without importing it (``helpers.needs.installed``), so the other worker never does.
# The unit is about two fifths of the lane's test time (wall), so the other worker
# takes the rest meanwhile.
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    unit = hf_unit(Path(config.rootpath))

    class HeaviestFirst(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = str(super()._split_scope(nodeid))
            return HF_UNIT if scope in unit else scope

        def _assign_work_unit(self, node: Any) -> None:
            # The heaviest unit still queued goes next; among the rest, xdist's order.
            first = min(self.workqueue, key=lambda s: rank.get(s, len(rank)))
            self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    return HeaviestFirst(config, log)
