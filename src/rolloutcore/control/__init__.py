"""Running updates (layer 4): the port to an engine and everything that drives it.

``port`` (the ``LifecycleAdapter`` an engine implements), ``runner`` (every
effect under a deadline), ``journal`` (append-only, typed on read-back),
``recovery`` (a replacement engine on a known checkpoint), ``session``
(``EngineSession``, the trainer API). Import from the modules.
"""

__all__: list[str] = []
