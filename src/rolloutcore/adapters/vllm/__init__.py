"""The vLLM adapter: lifecycle effects on a real vLLM server, over HTTP.

Modules, each one concern:

* ``http``: ``VllmHTTP``, a thin typed client of vLLM's own HTTP surface;
  its failures are translated where every client of vLLM translates them
  (``rolloutcore.engine.errors``);
* ``wire``: what vLLM's answers are parsed into (``WeightInfo``,
  ``Generation``, ``MetricsSnapshot``...);
* ``checksums``: ``/weight_checker`` checksums and their comparison;
* ``adapter``: ``VllmAdapter``, the port (``rolloutcore.control.port``) over
  a ``VllmHTTP`` and a weight transport; each step declares whether its
  failures may have changed the weights (``STEP_MAY_MUTATE``);
* ``sleep``: its sleep mode (``SleepMode``: colocated training on one GPU)
  and what it needs of a transport (``SleepAwareTransport``);
* ``process``: the managed vLLM process (``ManagedEngine``).

The names other code uses are re-exported here.
"""

from __future__ import annotations

from rolloutcore.adapters.vllm.adapter import (
    STEP_MAY_MUTATE,
    CheckingTransport,
    ProbeSet,
    VllmAdapter,
    engine_identity,
)
from rolloutcore.adapters.vllm.checksums import (
    EMPTY_SHA256,
    ChecksumComparison,
    WeightChecksums,
    compare_checksums,
)
from rolloutcore.adapters.vllm.http import (
    CACHE_ROUTES,
    KEEPALIVE_S,
    GenerationStream,
    Routes,
    VllmHTTP,
)
from rolloutcore.adapters.vllm.sleep import SleepAwareTransport, SleepMode
from rolloutcore.adapters.vllm.wire import (
    PREFIX_HITS,
    PREFIX_QUERIES,
    Completion,
    Generation,
    GenerationChunk,
    MetricsSnapshot,
    PrefixCacheDelta,
    VersionSpan,
    WeightInfo,
    WeightOps,
    prefix_cache_delta,
)

__all__ = [
    "CACHE_ROUTES",
    "EMPTY_SHA256",
    "KEEPALIVE_S",
    "PREFIX_HITS",
    "PREFIX_QUERIES",
    "STEP_MAY_MUTATE",
    "CheckingTransport",
    "ChecksumComparison",
    "Completion",
    "Generation",
    "GenerationChunk",
    "GenerationStream",
    "MetricsSnapshot",
    "PrefixCacheDelta",
    "ProbeSet",
    "Routes",
    "SleepAwareTransport",
    "SleepMode",
    "VersionSpan",
    "VllmAdapter",
    "VllmHTTP",
    "WeightChecksums",
    "WeightInfo",
    "WeightOps",
    "compare_checksums",
    "engine_identity",
    "prefix_cache_delta",
]
