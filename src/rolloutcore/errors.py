"""The one exception hierarchy of RolloutCore.

Everything RolloutCore raises on purpose is a ``RolloutCoreError``. Low-level
failures (an HTTP timeout, a reset connection, a dead process, a broken
collective) are caught at the boundary where they happen and re-raised as the
most specific class below with ``raise ... from exc``, so callers never need
to know which library failed. For HTTP to vLLM that boundary is one place,
``rolloutcore.engine.errors`` (httpx's ``map_exceptions`` is the model)::

    RolloutCoreError
    ├── BadInput (also a ValueError)          bad argument; nothing changed
    │   ├── RequestTooLarge                   a request body over the configured limit
    │   ├── RouteRefused                      no engine may answer the request (its HTTP status)
    │   └── ReplayRefused                     replay refused: engine not at the recorded version
    ├── InvalidTransition                     event not legal in this state
    ├── AdmissionRefused                      no rollout admitted; says when to retry
    ├── UpdateRefused                         update not started; nothing changed
    ├── EvidenceRejected                      an effect's evidence failed its postcondition
    ├── EffectError                           an adapter effect failed
    │   ├── EffectTimeout                     ... or overran its deadline
    │   ├── EngineUnavailable                 ... because the engine cannot be reached (or 5xx)
    │   │   └── EngineUnreachable             ... and the request was never delivered
    │   ├── EngineRefused                     ... because an engine route answered 4xx
    │   │   └── RequestRejected (also a BadInput)  ... to a request it found malformed
    │   └── TransferError                     ... during a weight transfer
    ├── UpdateFailed                          a whole update ended without a publish
    └── JournalError                          the journal cannot be read or written

``EffectError.mutation_started`` is the failure policy's input: whether the
engine's weights may have changed before the failure. The HTTP boundary
cannot know it (none of its calls moves weights, but a cache reset after a
transfer meets weights the transfer changed), so what it raises says
``True`` (unknown); the adapter step that can prove otherwise says so, once
per step (``rolloutcore.engine.port.STEP_MAY_MUTATE``).

The pure core (``lifecycle``, ``evidence``, ``versions``) uses this module; it
imports only the standard library.
"""

from __future__ import annotations

__all__ = [
    "AdmissionRefused",
    "BadInput",
    "EffectError",
    "EffectTimeout",
    "EngineRefused",
    "EngineUnavailable",
    "EngineUnreachable",
    "EvidenceRejected",
    "InvalidTransition",
    "JournalError",
    "ReplayRefused",
    "RequestRejected",
    "RequestTooLarge",
    "RolloutCoreError",
    "RouteRefused",
    "TransferError",
    "UpdateFailed",
    "UpdateRefused",
]


class RolloutCoreError(Exception):
    """Base class of every error RolloutCore raises on purpose."""


class BadInput(RolloutCoreError, ValueError):
    """An argument is malformed; the call changed nothing."""


class RequestTooLarge(BadInput):
    """A request body exceeds the configured limit; it was not read further."""


class RouteRefused(BadInput):
    """No engine is routed to: ``status`` is the HTTP answer (4xx, or 503 + Retry-After).

    A request that can never be served as asked (a version never published) is
    a 4xx; one that only cannot be served now is a 503 with ``retry_after_s``.
    Nothing was admitted or forwarded.
    """

    def __init__(self, status: int, message: str, *, retry_after_s: float | None = None,
                 kind: str = "BadRequest") -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s
        self.kind = kind


class ReplayRefused(BadInput):
    """The engine is not at the recorded version (or cannot say): nothing was replayed."""


class InvalidTransition(RolloutCoreError):
    """An event arrived in a state whose table has no entry for it."""

    def __init__(self, event: str, state: str, detail: str = "") -> None:
        self.event = event
        self.state = state
        msg = f"event {event!r} is not legal in state {state}"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class AdmissionRefused(RolloutCoreError):
    """A rollout was not admitted. ``retry_after_s`` is a hint, ``None`` = never."""

    def __init__(self, state: str, reason: str, retry_after_s: float | None) -> None:
        self.state = state
        self.reason = reason
        self.retry_after_s = retry_after_s
        when = "do not retry" if retry_after_s is None else f"retry after {retry_after_s:g}s"
        super().__init__(f"admission refused in {state}: {reason} ({when})")


class UpdateRefused(RolloutCoreError):
    """An update request was refused before anything happened."""


class EvidenceRejected(RolloutCoreError):
    """Evidence returned by an effect does not establish its postcondition."""

    def __init__(self, step: str, reason: str) -> None:
        self.step = step
        self.reason = reason
        super().__init__(f"{step}: {reason}")


class EffectError(RolloutCoreError):
    """An adapter effect failed.

    ``mutation_started`` says whether the engine's weights may have changed
    before the failure: ``False`` only when the adapter can prove they did not.
    """

    def __init__(self, step: str, reason: str, *, mutation_started: bool = True) -> None:
        self.step = step
        self.reason = reason
        self.mutation_started = mutation_started
        super().__init__(f"{step}: {reason}")


class EffectTimeout(EffectError):
    """An effect overran its deadline (the request may have arrived: never a refusal).

    ``detail`` says what was being waited for, where the step alone does not.
    """

    def __init__(self, step: str, deadline_s: float, *, mutation_started: bool = True,
                 detail: str = "") -> None:
        self.deadline_s = deadline_s
        reason = f"deadline of {deadline_s:g}s expired"
        super().__init__(step, f"{reason}: {detail}" if detail else reason,
                         mutation_started=mutation_started)


class EngineUnavailable(EffectError):
    """The engine could not be reached or answered with a server error (HTTP 5xx).

    ``status`` is the HTTP status when the engine answered, else ``None``.
    """

    def __init__(self, step: str, reason: str, *, mutation_started: bool = True,
                 status: int | None = None) -> None:
        self.status = status
        super().__init__(step, reason, mutation_started=mutation_started)


class EngineUnreachable(EngineUnavailable):
    """The request never reached the engine (the connection could not be made).

    Nothing was delivered, so nothing on the engine acted on it: a caller
    whose step is otherwise safe may treat it as a refusal.
    """


class EngineRefused(EffectError):
    """An engine route answered HTTP 4xx: the engine refused the request before acting.

    Also what a route the engine does not offer (HTTP 403, or 404/405 on a
    path absent from its ``/openapi.json``) raises: not our request's fault.
    """

    def __init__(self, step: str, reason: str, *, status: int,
                 mutation_started: bool = True) -> None:
        self.status = status
        super().__init__(step, reason, mutation_started=mutation_started)


class RequestRejected(EngineRefused, BadInput):
    """The engine found a request we built malformed (a 4xx on a route it offers).

    A ``BadInput`` as well: the argument that went into the request was bad.
    """


class TransferError(EffectError):
    """A weight transfer failed."""


class UpdateFailed(RolloutCoreError):
    """An update ended without publishing its target.

    ``classification`` is the failure-policy class that was applied
    (``no_mutation``, ``incomplete`` or ``ambiguous``); ``state`` is where the
    controller ended (READY when nothing mutated, TAINTED otherwise).
    """

    def __init__(self, phase: str, classification: str, state: str, reason: str) -> None:
        self.phase = phase
        self.classification = classification
        self.state = state
        self.reason = reason
        self.outcome: object | None = None  # the runner's UpdateOutcome, when it has one
        super().__init__(f"update failed in {phase} ({classification}, now {state}): {reason}")


class JournalError(RolloutCoreError):
    """The journal could not be written or read back."""
