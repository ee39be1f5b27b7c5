"""Running updates (layer 4): the port to an engine and everything that drives it.

``port`` (the ``LifecycleAdapter`` an engine implements), ``runner`` (every
effect under a deadline), ``journal`` (append-only, typed on read-back),
``stack`` (the one composition). No module here imports vLLM code (the
``engine`` package): the trainer API that launches and drives vLLM is
``rolloutcore.session``, the recoverers that restart it ``engine.recovery``.
Import from the modules.
"""

__all__: list[str] = []
