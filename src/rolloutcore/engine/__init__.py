"""The engine boundary: the one room of RolloutCore that knows vLLM's HTTP surface.

House rules (h11's ``_state.py`` form: what this package owns, what it never
touches):

* **Every vLLM route RolloutCore names is in** ``engine.routes``: its path,
  method, whether it mutates the engine, the vLLM minor versions that serve
  it and whether it is a dev-mode route. No other module spells a vLLM route
  (``tests/test_layering.py`` fails on one); support detection, the route
  guard and the clients read the table.
* **Every failed call to vLLM becomes a** ``rolloutcore.errors`` **exception
  here** (``engine.errors``: one map, most specific httpx exception first,
  ``raise ... from exc``), for calls and for streams, sync and async. No other
  module catches ``httpx.HTTPError`` for itself.
* The modules of this package import the standard library and
  ``rolloutcore.errors`` only at import time; httpx is imported where a
  request is made, so the route guard (run inside vLLM's API server) and the
  worker halves of the transports can read the table cheaply.

* **A transport takes a weight-sync client** (``engine.weight_sync``: vLLM's
  four methods, init/start/update/finish, over the table's routes and the
  one map) instead of posting routes itself: the fan-out and the CUDA-IPC
  trainer do.

* **Only** ``engine.client`` **builds an HTTP client**: ``EngineClient`` and
  its async twin ``AsyncEngineClient`` (httpx's ``BaseTransport`` /
  ``AsyncBaseTransport`` pair: one method set, ``transport=`` a test's
  ``httpx.MockTransport``). ``VllmHTTP`` (``engine.http``), the weight-sync
  client, the launcher's probes, the TRL engines and the gateway's read-only
  routes hold one (``tests/test_layering.py``).
* What lives here: ``port`` (``VllmAdapter``, the lifecycle port over vLLM)
  and ``expected`` (what an update is checked against),
  ``http``/``stream``/``wire`` (the typed client and what answers parse to),
  ``upstream`` (the gateway's hand-written data-path pool, httptools),
  ``process`` + ``launch_guard`` (the launcher), ``recovery`` (the
  ``control.port.Recoverer`` pair: restart a launched engine, or wait for an
  operator's, and verify it), ``support`` (which vLLM is supported), ``sleep``,
  ``state``, ``verify``, ``sent``, ``args``. In RolloutCore "adapter" means a
  LoRA adapter; the vLLM side is "the engine". (``VllmAdapter`` keeps its
  name: it is public API, exported at ``rolloutcore`` and used in
  ``docs/async-modes.md``.)

Still outside: the gloo and vLLM-driver transports' calls
(``TransportBase.post``); they name routes from ``routes`` and map failures
with ``errors``.
"""

from rolloutcore.engine.routes import TABLE, Route, Routes

__all__ = ["TABLE", "Route", "Routes"]
