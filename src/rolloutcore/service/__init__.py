"""RolloutCore as a service: a gateway in front of one vLLM server.

``app`` builds the Starlette application; ``proxy`` is the data plane (every
request admitted, bound to the committed version, released, answered with
that version); ``control`` is the trainer protocol (begin, lease, report);
``metrics``, ``auth`` and ``config`` are what their names say; ``serve`` is
the ``rolloutcore serve`` command.
"""

from rolloutcore.service.app import Gateway, create_app
from rolloutcore.service.config import ServiceConfig

__all__ = ["Gateway", "ServiceConfig", "create_app"]
