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

What is still outside (issue 45, moved here step by step): the clients
(``adapters.vllm.http.VllmHTTP``, the gateway's ``service.upstream``), the
launcher, support detection and the gloo and vLLM-driver transports' calls
(``TransportBase.post``); they name routes from ``routes`` and map failures
with ``errors``.
"""

from rolloutcore.engine.routes import TABLE, Route, Routes

__all__ = ["TABLE", "Route", "Routes"]
