"""Version-aware routing: which replica may answer a request, and which one does.

A request names a *policy* (header ``X-RolloutCore-Policy`` or body field
``rolloutcore_policy``; the gateway's default otherwise):

``latest``            only replicas on the newest published fleet version;
``any``               any serving replica (whatever published version it is on);
``min-version:N``     a fleet version >= N (N above the newest: refused, 409);
``max-staleness:k``   at most k versions behind the newest;
``pinned:<label>``    exactly the fleet version published under ``label``
                      (never published: 404; no replica holds it any more: 410).

Among the eligible replicas (in the pool, ``core.pool.IN_POOL``, their engine
READY on the version they entered it with) the ones that answered well
recently come first, then the least loaded by active rollouts, ties in turn.
The samples of one group stay on one replica while it is eligible (prefix-cache
reuse): a group is an explicit id (``X-RolloutCore-Group`` / ``rolloutcore_group``) or, for a
request with ``n > 1``, its prompt. When no replica can serve the policy the
answer is a 503 with Retry-After, never another version; during a
synchronous update every policy gets that 503 (admission is closed
fleet-wide).

Standard library only, no I/O, no clock: the gateway builds a ``FleetView``
from the coordinator and asks ``Router.choose``.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import json
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from rolloutcore.core.versions import WeightVersion, check_label
from rolloutcore.errors import BadInput, RouteRefused

__all__ = [
    "GROUP_FIELD",
    "GROUP_HEADER",
    "POLICY_FIELD",
    "POLICY_HEADER",
    "FleetView",
    "Policy",
    "PolicyKind",
    "ReplicaView",
    "RouteRefused",
    "Router",
    "eligible",
    "group_key",
    "request_policy",
]

POLICY_HEADER = "x-rolloutcore-policy"
GROUP_HEADER = "x-rolloutcore-group"
POLICY_FIELD = "rolloutcore_policy"
GROUP_FIELD = "rolloutcore_group"
#: Matched with ``fullmatch`` (``$`` alone lets a trailing newline through).
_GROUP_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}")
_INT_RE = re.compile(r"0|[1-9][0-9]{0,17}")


class PolicyKind(enum.StrEnum):
    LATEST = "latest"
    ANY = "any"
    MIN_VERSION = "min-version"
    MAX_STALENESS = "max-staleness"
    PINNED = "pinned"


@dataclass(frozen=True)
class Policy:
    kind: PolicyKind
    value: int | str | None = None

    @classmethod
    def parse(cls, text: object) -> Policy:
        """``latest``, ``any``, ``min-version:N``, ``max-staleness:k``, ``pinned:<label>``."""
        if not isinstance(text, str) or not text.strip():
            raise RouteRefused(400, f"routing policy must be a non-empty string, got {text!r}")
        s = text.strip()
        name, sep, arg = s.partition(":")
        try:
            kind = PolicyKind(name.lower())
        except ValueError:
            raise RouteRefused(400, f"unknown routing policy {s[:80]!r}: use latest, any, "
                               "min-version:N, max-staleness:k or pinned:<label>") from None
        if kind in (PolicyKind.LATEST, PolicyKind.ANY):
            if sep:
                raise RouteRefused(400, f"routing policy {kind.value!r} takes no argument")
            return cls(kind)
        if not sep or not arg:
            raise RouteRefused(400, f"routing policy {kind.value!r} needs an argument "
                               f"({kind.value}:{'<label>' if kind is PolicyKind.PINNED else 'N'})")
        if kind is PolicyKind.PINNED:
            try:
                return cls(kind, check_label(arg))
            except BadInput as exc:
                raise RouteRefused(400, f"pinned: {exc}") from None
        if not _INT_RE.fullmatch(arg):
            raise RouteRefused(400, f"{kind.value} needs an integer >= 0, got {arg[:40]!r}")
        return cls(kind, int(arg))

    def __str__(self) -> str:
        return self.kind.value if self.value is None else f"{self.kind.value}:{self.value}"


@dataclass(frozen=True)
class ReplicaView:
    """One replica as the router sees it."""

    name: str
    in_pool: bool                 # SERVING, its engine READY on ``engine_version``
    generation: int | None        # the fleet version it holds (in the pool or not)
    load: int                     # active rollouts
    #: The engine version it serves ``generation`` as: admission on its controller
    #: is asked for exactly this version (``LifecycleController.admit(expect=)``).
    engine_version: WeightVersion | None = None


@dataclass(frozen=True)
class FleetView:
    replicas: tuple[ReplicaView, ...]
    newest: int | None                       # newest published fleet version
    labels: Mapping[str, int] = field(default_factory=dict)  # published label -> version
    closed: str | None = None                # why admission is closed fleet-wide, or None
    retry_after_s: float = 1.0


def eligible(view: FleetView, policy: Policy) -> list[ReplicaView]:
    """The replicas that may answer under ``policy``; raises ``RouteRefused`` otherwise.

    A request that can never be served as asked (a label never published, a
    min-version in the future) is a 4xx; one that only cannot be served now
    is a 503 with Retry-After.
    """
    if view.closed is not None:
        raise RouteRefused(503, f"admission is closed fleet-wide: {view.closed}",
                           retry_after_s=view.retry_after_s, kind="ServiceUnavailable")
    newest = view.newest
    if newest is None:
        raise RouteRefused(503, "the fleet has published no version yet",
                           retry_after_s=view.retry_after_s, kind="ServiceUnavailable")
    k = policy.kind
    want: set[int] | None = None
    lo = 0
    if k is PolicyKind.LATEST:
        lo = newest
    elif k is PolicyKind.MIN_VERSION:
        assert isinstance(policy.value, int)
        if policy.value > newest:
            raise RouteRefused(409, f"min-version:{policy.value} is newer than the newest "
                               f"published fleet version ({newest})", kind="Conflict")
        lo = policy.value
    elif k is PolicyKind.MAX_STALENESS:
        assert isinstance(policy.value, int)
        lo = max(0, newest - policy.value)
    elif k is PolicyKind.PINNED:
        assert isinstance(policy.value, str)
        gen = view.labels.get(policy.value)
        if gen is None:
            raise RouteRefused(404, f"pinned:{policy.value}: no fleet version was published "
                               "under that label", kind="NotFound")
        if not any(r.generation == gen for r in view.replicas):
            raise RouteRefused(410, f"pinned:{policy.value}: fleet version {gen} is no longer "
                               "held by any replica", kind="Gone")
        want = {gen}
    out = [r for r in view.replicas if r.in_pool and r.generation is not None
           and r.generation >= lo and (want is None or r.generation in want)]
    if not out:
        served = sorted({r.generation for r in view.replicas
                         if r.in_pool and r.generation is not None})
        raise RouteRefused(503, f"no serving replica satisfies {policy} now (versions being "
                           f"served: {served or 'none'}; newest {newest})",
                           retry_after_s=view.retry_after_s, kind="ServiceUnavailable")
    return out


class Router:
    """Recent success first, then least active rollouts; a group sticks to its replica.

    ``observe(name, ok)`` feeds each answer's outcome into a decaying failure
    score per replica (``score = decay * score + (1 - decay) * failed``): a
    replica whose engine fails fast (a dead one answers its 502s in
    milliseconds, so it always looks least loaded) loses the traffic to one
    that answers, without waiting for the supervisor to fence it. Replicas
    whose scores are within ``tolerance`` of the best count as equally good,
    and among them the least loaded wins, ties in turn. ``max_groups``
    bounds the remembered groups (least recently used go first). Not
    thread-safe: the gateway calls it from its event loop.
    """

    max_groups, decay, tolerance = 4096, 0.8, 0.25

    def __init__(self) -> None:
        self._groups: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._turn = 0
        self._fail: dict[str, float] = {}

    def observe(self, name: str, ok: bool) -> None:
        """An answer from ``name``: its engine answered (``ok``), or failed to."""
        s = self.decay * self._fail.get(name, 0.0) + (1.0 - self.decay) * (0.0 if ok else 1.0)
        if s < 1e-3:
            self._fail.pop(name, None)
        else:
            self._fail[name] = s

    def failure_score(self, name: str) -> float:
        return self._fail.get(name, 0.0)

    def choose(self, view: FleetView, policy: Policy, group: str | None = None,
               exclude: Collection[str] = ()) -> ReplicaView:
        """The replica for one request (``exclude``: replicas that refused it already)."""
        cands = [r for r in eligible(view, policy) if r.name not in exclude]
        if not cands:
            raise RouteRefused(503, f"no serving replica could take it under {policy} now",
                               retry_after_s=view.retry_after_s, kind="ServiceUnavailable")
        if group is not None:
            name = self._groups.get(group)
            if name is not None:
                for r in cands:
                    if r.name == name and self.failure_score(name) < 0.5:
                        self._groups.move_to_end(group)
                        return r
        best_score = min(self.failure_score(r.name) for r in cands)
        cands = [r for r in cands if self.failure_score(r.name) <= best_score + self.tolerance]
        low = min(r.load for r in cands)
        best = [r for r in cands if r.load == low]
        self._turn += 1
        pick = best[self._turn % len(best)]
        if group is not None:
            self._groups[group] = pick.name
            self._groups.move_to_end(group)
            while len(self._groups) > self.max_groups:
                self._groups.popitem(last=False)
        return pick

    def forget(self, replica: str) -> None:
        """Drop the groups of a replica that left (they re-stick on their next request)."""
        for g in [g for g, n in self._groups.items() if n == replica]:
            del self._groups[g]


def request_policy(header: str | None, body: Mapping[str, Any],
                   default: Policy) -> Policy:
    """The request's policy from its header or body field (both: they must agree)."""
    field_v = body.get(POLICY_FIELD)
    if field_v is not None and not isinstance(field_v, str):
        raise RouteRefused(400, f"'{POLICY_FIELD}' must be a string")
    from_h = Policy.parse(header) if header is not None else None
    from_b = Policy.parse(field_v) if field_v is not None else None
    if from_h is not None and from_b is not None and from_h != from_b:
        raise RouteRefused(400, f"the {POLICY_HEADER} header ({from_h}) and the "
                           f"'{POLICY_FIELD}' field ({from_b}) disagree")
    return from_h or from_b or default


def group_key(header: str | None, body: Mapping[str, Any]) -> str | None:
    """The request's sample group: an explicit id, or its prompt when it asks n > 1."""
    field_v = body.get(GROUP_FIELD)
    explicit: list[str] = []
    for where, v in ((GROUP_HEADER, header), (GROUP_FIELD, field_v)):
        if v is None:
            continue
        if not isinstance(v, str) or not _GROUP_RE.fullmatch(v):
            raise RouteRefused(400, f"{where} must match {_GROUP_RE.pattern}")
        explicit.append(v)
    if len(explicit) == 2 and explicit[0] != explicit[1]:
        raise RouteRefused(400, f"the {GROUP_HEADER} header and the '{GROUP_FIELD}' field "
                           "disagree")
    if explicit:
        return "g:" + explicit[0]
    sp = body.get("sampling_params")
    n = body.get("n", sp.get("n") if isinstance(sp, Mapping) else None)
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        prompt = {k: body[k] for k in ("prompt", "messages", "token_ids") if k in body}
        blob = json.dumps(prompt, sort_keys=True, separators=(",", ":"), default=str)
        return "p:" + hashlib.sha256(blob.encode()).hexdigest()[:32]
    return None
