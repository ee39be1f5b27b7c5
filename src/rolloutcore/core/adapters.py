"""LoRA-adapter versions: the machine that loads, verifies, publishes and retires them.

House rules, as ``core.lifecycle``'s and ``core.lease``'s: one table decides
(``ADAPTER_TRANSITIONS``: the one target of each legal (state, event);
anything else is an ``InvalidTransition`` that changes nothing), nothing here
locks, reads a clock or does I/O; the shell (``control.shell``, driven by
``control.adapters.AdapterManager``) runs it, hands its records to the journal
after its lock is released and publishes a snapshot (``AdapterView``).

Why an adapter update is not the engine lifecycle's transaction. A full update
rewrites the weights every running request reads, so it must drain (or carry)
them first. Loading an adapter writes a *new* LoRA slot under a *new* name and
touches no request running on another slot or on the base: a request names its
adapter, so it is version-pure by construction, without a drain or a pause.
What remains of the transaction is what makes it trustworthy: one writer at a
time, the adapter verified (listed, probed through it, the base probed beside
it) before any request is routed to it, and every step recorded. So the
adapter's machine is its own, lighter one, per adapter version:

    LOADING --loaded--> VERIFYING --verified--> PUBLISHED --superseded--> STANDBY
       |                   |                                                |
    rejected             failed                                           unload
       v                   v                                                v
    REFUSED <--unloaded-- REFUSING --failed--> FENCED <--failed-- UNLOADING --unloaded--> RETIRED

* ``rejected``: the engine refused the load (a 4xx): nothing was loaded.
* ``failed`` from LOADING or VERIFYING: the load may have happened (a
  timeout) or verification failed; the adapter is unloaded (REFUSING), never
  routed to. An unload that fails leaves it FENCED: maybe loaded, never
  routed, its slot counted until the engine is replaced.
* A superseded adapter stays loaded (STANDBY) while requests bound to it run
  and while it is among the ``max_staleness`` newest superseded ones (TRL keeps
  ``max_staleness + 1`` adapters loaded); ``evictable`` names the others.
* ``withdrawn``: the client unloaded it (vLLM's ``/v1/unload_lora_adapter`` on
  the gateway, ``service.native_lora``). The published one stops being current
  (new requests get no adapter), and either one waits in STANDBY only for the
  requests bound to it: ``evictable`` names it then, whatever ``max_staleness``.

Names are never reused (``seen``: every name this table ever proposed or
found loaded), and each is content-addressed (``adapter_name``): vLLM 0.32 keys
its prefix cache by the adapter's (name, path), so a new name and path per
version make a hit on another version's KV impossible (vLLM #59335).

A load is refused *before anything changes* when it would not fit: more
adapters loaded than ``max_loaded`` (``--max-loras`` bounds the adapters of one
batch, not those loaded; ``max_loaded`` is the CPU/GPU LoRA cache,
``--max-cpu-loras``), or more adapter bytes than ``max_bytes``.

Standard library only.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from rolloutcore.core.strict import HEX64, check_int
from rolloutcore.core.vocab import Machine, Record, TypedRecord
from rolloutcore.errors import AdmissionRefused, BadInput, InvalidTransition, UpdateRefused

__all__ = [
    "ADAPTER_RECORDS",
    "ADAPTER_TRANSITIONS",
    "AdapterBinding",
    "AdapterChange",
    "AdapterConfig",
    "AdapterEvent",
    "AdapterState",
    "AdapterTable",
    "AdapterVersion",
    "AdapterView",
    "LOADED_STATES",
    "adapter_name",
]

#: What vLLM accepts as a LoRA name and what travels in headers and paths.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
NAME_PREFIX = "rcl"
#: Retry-After of an admission refused while an adapter's publish is being recorded (the
#: gateway's queue holds it and retries once the record is on disk).
_RECORDING_RETRY_S = 1.0


def adapter_name(generation: int, content_digest: str) -> str:
    """The adapter version's name: its generation and its content (never reused).

    The generation makes it unique per table even for equal content; the
    digest makes it say what it holds.
    """
    check_int("adapter generation", generation, 1)
    if not isinstance(content_digest, str) or not HEX64.fullmatch(content_digest):
        raise BadInput("adapter content_digest must be a sha256 hex digest")
    return f"{NAME_PREFIX}-{generation}-{content_digest[:16]}"


class AdapterState(enum.StrEnum):
    LOADING = "loading"        # the load was asked of the engine
    VERIFYING = "verifying"    # the engine lists it: probes run, nothing routed to it
    PUBLISHED = "published"    # the current adapter: new requests get it
    STANDBY = "standby"        # superseded, still loaded (bound requests, staleness)
    UNLOADING = "unloading"    # superseded and evicted: the unload was asked
    RETIRED = "retired"        # unloaded (final)
    REFUSING = "refusing"      # failed verification (or its load): being unloaded
    REFUSED = "refused"        # never published, not loaded (final)
    FENCED = "fenced"          # an unload failed: maybe loaded, never routed (final)


class AdapterEvent(enum.StrEnum):
    LOADED = "loaded"          # the load route answered and the engine lists the name
    REJECTED = "rejected"      # the engine refused the load (nothing loaded)
    VERIFIED = "verified"      # every probe passed: publish
    FAILED = "failed"          # a step failed (its reason recorded)
    SUPERSEDED = "superseded"  # a newer adapter was published
    UNLOAD = "unload"          # evicted: the unload is asked
    UNLOADED = "unloaded"      # the engine no longer lists it
    WITHDRAWN = "withdrawn"    # the client unloaded it: retired once nothing bound runs


S, E = AdapterState, AdapterEvent

#: (state, event) -> the one state it leads to.
ADAPTER_TRANSITIONS: Mapping[tuple[AdapterState, AdapterEvent], AdapterState] = {
    (S.LOADING, E.LOADED): S.VERIFYING,
    (S.LOADING, E.REJECTED): S.REFUSED,
    (S.LOADING, E.FAILED): S.REFUSING,
    (S.VERIFYING, E.VERIFIED): S.PUBLISHED,
    (S.VERIFYING, E.FAILED): S.REFUSING,
    (S.REFUSING, E.UNLOADED): S.REFUSED,
    (S.REFUSING, E.FAILED): S.FENCED,
    (S.PUBLISHED, E.SUPERSEDED): S.STANDBY,
    (S.PUBLISHED, E.WITHDRAWN): S.STANDBY,
    (S.STANDBY, E.WITHDRAWN): S.STANDBY,
    (S.STANDBY, E.UNLOAD): S.UNLOADING,
    (S.UNLOADING, E.UNLOADED): S.RETIRED,
    (S.UNLOADING, E.FAILED): S.FENCED,
}

#: States whose adapter may be in the engine: each holds a slot and its bytes.
LOADED_STATES = frozenset({S.LOADING, S.VERIFYING, S.PUBLISHED, S.STANDBY, S.UNLOADING,
                           S.REFUSING, S.FENCED})
#: The states of the one adapter update in progress (one writer).
IN_PROGRESS = frozenset({S.LOADING, S.VERIFYING, S.REFUSING})


@dataclass(frozen=True)
class AdapterVersion:
    """One adapter version: what requests bound to it name, on which base it was verified.

    ``base`` is the label of the base version the adapter was loaded on and
    verified against (``WeightVersion.label``); ``content_digest`` the sha256 of
    the adapter's tensors and config (``verification.adapters``); ``path`` where
    the engine read it from (a directory named after the version).
    """

    generation: int
    name: str
    path: str
    content_digest: str
    base: str
    size_bytes: int = 0

    def __post_init__(self) -> None:
        check_int("adapter generation", self.generation, 1)
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise BadInput(f"adapter name must match {_NAME_RE.pattern}, got {self.name!r}")
        if not isinstance(self.path, str) or not self.path:
            raise BadInput("adapter path must be a non-empty string")
        if not isinstance(self.content_digest, str) or not HEX64.fullmatch(self.content_digest):
            raise BadInput("adapter content_digest must be a sha256 hex digest")
        if not isinstance(self.base, str) or not self.base:
            raise BadInput("adapter base must be the base version's label")
        check_int("adapter size_bytes", self.size_bytes)

    def to_dict(self) -> dict[str, object]:
        return {"generation": self.generation, "name": self.name, "path": self.path,
                "content_digest": self.content_digest, "base": self.base,
                "size_bytes": self.size_bytes}

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> AdapterVersion:
        try:
            return cls(d["generation"], d["name"], d["path"],  # type: ignore[arg-type]
                       d["content_digest"], d["base"], d.get("size_bytes", 0))  # type: ignore[arg-type]
        except (KeyError, TypeError) as exc:
            raise BadInput(f"not an AdapterVersion: {d!r}") from exc


@dataclass(frozen=True)
class AdapterBinding:
    """A request bound to (base version, adapter version): what its answer records."""

    rollout_id: str
    adapter: AdapterVersion

    def to_dict(self) -> dict[str, object]:
        return {"rollout_id": self.rollout_id, "adapter": self.adapter.name,
                "adapter_generation": self.adapter.generation,
                "adapter_digest": self.adapter.content_digest, "base": self.adapter.base}


@dataclass(frozen=True)
class AdapterConfig:
    """The budget of loaded adapters and how many superseded ones stay loaded."""

    max_loaded: int = 4
    max_staleness: int = 1
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        for what, v, lo in (("max_loaded", self.max_loaded, 1),
                            ("max_staleness", self.max_staleness, 0)):
            check_int(what, v, lo)
        if self.max_bytes is not None and (isinstance(self.max_bytes, bool)
                                           or not isinstance(self.max_bytes, int)
                                           or self.max_bytes < 1):
            raise BadInput(f"max_bytes must be an int >= 1 or None, got {self.max_bytes!r}")
        if self.max_loaded < self.max_staleness + 2:
            # The current one, max_staleness superseded ones, and the one being loaded.
            raise BadInput(f"max_loaded ({self.max_loaded}) must be at least max_staleness + 2 "
                           f"({self.max_staleness + 2}): the published adapter, "
                           f"{self.max_staleness} superseded ones and the next one")


@dataclass(frozen=True)
class AdapterChange(TypedRecord):
    """An adapter version's state changed (``ADAPTER_TRANSITIONS``); ``before`` None: proposed.

    Every change carries the version's name, generation, content digest and
    base label, so the journal alone says which adapter served what.
    """

    KIND: ClassVar[str] = "adapter"
    name: str
    generation: int
    content_digest: str
    base: str
    path: str
    before: AdapterState | None
    after: AdapterState
    event: AdapterEvent | None
    reason: str = ""
    evidence: tuple[str, ...] = ()

    @property
    def version_key(self) -> tuple[int, str, str]:
        """(generation, content digest, base label): the version, as a sample names it."""
        return (self.generation, self.content_digest, self.base)


ADAPTER_RECORDS: tuple[type[Record], ...] = (AdapterChange,)


@dataclass(frozen=True)
class AdapterView:
    """The published snapshot: the current adapter and each loaded one's state and bound count."""

    current: AdapterVersion | None
    states: Mapping[str, AdapterState] = field(default_factory=dict)
    bound: Mapping[str, int] = field(default_factory=dict)
    broken: str | None = None


class AdapterTable(Machine):
    """The adapter versions of one engine, sans I/O (see the module docstring)."""

    def __init__(self, config: AdapterConfig | None = None, *, now: float = 0.0) -> None:
        super().__init__(now)
        self.config = config or AdapterConfig()
        if not isinstance(self.config, AdapterConfig):
            raise BadInput("config must be an AdapterConfig")
        self._versions: dict[str, AdapterVersion] = {}
        self._states: dict[str, AdapterState] = {}
        self._bound: dict[str, int] = {}
        self._rollouts: dict[str, str] = {}        # rollout id -> adapter name
        self._published: list[str] = []            # names, in publication order
        self._seen: set[str] = set()
        self._current: str | None = None
        self._withdrawn: set[str] = set()          # unloaded by the client: no staleness
        self._generation = 0

    # ---------------------------------------------------------------- reading
    @property
    def current(self) -> AdapterVersion | None:
        return None if self._current is None else self._versions[self._current]

    @property
    def next_generation(self) -> int:
        return self._generation + 1

    def state(self, name: str) -> AdapterState | None:
        return self._states.get(name)

    def version(self, name: str) -> AdapterVersion | None:
        return self._versions.get(name)

    def bound(self, name: str) -> int:
        return self._bound.get(name, 0)

    def loaded(self) -> list[AdapterVersion]:
        return [self._versions[n] for n, s in self._states.items() if s in LOADED_STATES]

    def in_progress(self) -> AdapterVersion | None:
        for n, s in self._states.items():
            if s in IN_PROGRESS:
                return self._versions[n]
        return None

    def seen(self, name: str) -> bool:
        return name in self._seen

    def view(self) -> AdapterView:
        return AdapterView(self.current, dict(self._states), dict(self._bound), self._broken)

    def commits(self, record: Record) -> bool:
        """An adapter's publish: nothing is bound to it before it is on record."""
        return isinstance(record, AdapterChange) and record.after is S.PUBLISHED

    def evictable(self) -> list[AdapterVersion]:
        """Superseded adapters that may be unloaded now: nothing bound to them runs and
        they are not among the ``max_staleness`` newest superseded ones."""
        standby = [n for n in self._published if self._states.get(n) is S.STANDBY]
        kept = [n for n in standby if n not in self._withdrawn]
        keep = set(kept[len(kept) - self.config.max_staleness:]) \
            if self.config.max_staleness else set()
        return [self._versions[n] for n in standby if n not in keep and not self._bound.get(n)]

    def fits(self, size_bytes: int) -> str | None:
        """Why one more adapter of ``size_bytes`` would not fit now (None: it fits)."""
        loaded = self.loaded()
        if len(loaded) + 1 > self.config.max_loaded:
            held = ", ".join(f"{v.name} ({self._states[v.name].value}, "
                             f"{self._bound.get(v.name, 0)} bound)" for v in loaded)
            return (f"{len(loaded)} adapters loaded, the budget is {self.config.max_loaded}: "
                    f"{held}")
        if self.config.max_bytes is not None:
            used = sum(v.size_bytes for v in loaded)
            if used + size_bytes > self.config.max_bytes:
                return (f"{used} + {size_bytes} adapter bytes exceed the budget of "
                        f"{self.config.max_bytes}")
        return None

    # ---------------------------------------------------------------- decisions
    def note_loaded(self, names: Mapping[str, str]) -> None:
        """Names the engine lists that this table did not load (another controller's,
        an earlier incarnation's): never reused, never routed to. Records nothing."""
        for n in names:
            self._seen.add(str(n))

    def restore(self, changes: Iterable[AdapterChange]) -> AdapterVersion | None:
        """A previous controller's adapter records (its journal): every name it used is
        never reused, generations continue above its highest, and the version it had
        published last is returned. Nothing is claimed loaded or routed to (the
        engine may be another process: the caller loads and verifies that version
        again, under a new name). Records nothing; only before any proposal."""
        if self._versions:
            raise UpdateRefused("restore only into a table that proposed nothing yet")
        current: AdapterVersion | None = None
        for ch in changes:
            if not isinstance(ch, AdapterChange):
                raise BadInput(f"not an adapter record: {ch!r}")
            v = AdapterVersion(ch.generation, ch.name, ch.path, ch.content_digest, ch.base)
            self._seen.add(ch.name)
            self._generation = max(self._generation, ch.generation)
            if ch.after is S.PUBLISHED:
                current = v
            elif current is not None and ch.name == current.name and (ch.after in (
                    S.RETIRED, S.FENCED, S.UNLOADING) or ch.event is E.WITHDRAWN):
                current = None
        return current

    def propose(self, version: AdapterVersion) -> None:
        """Open the update of ``version`` (LOADING); refused, changing nothing, when another
        is in progress, its name was ever seen, its generation is below the next one,
        or it would not fit."""
        self._refuse_if_broken()
        if not isinstance(version, AdapterVersion):
            raise BadInput("propose needs an AdapterVersion")
        busy = self.in_progress()
        if busy is not None:
            raise UpdateRefused(f"adapter {busy.name} is {self._states[busy.name].value}: "
                                f"one adapter update at a time")
        if version.name in self._seen:
            raise UpdateRefused(f"adapter name {version.name!r} was used before (vLLM keys its "
                                f"prefix cache by name and path: a reused name could serve "
                                f"another version's KV); nothing was changed")
        if version.generation < self.next_generation:
            # Above it is fine: a fleet names a version after the highest generation of
            # all its replicas' tables, so one name is new on every one of them.
            raise BadInput(f"adapter generation must be {self.next_generation} or more, "
                           f"got {version.generation}")
        why = self.fits(version.size_bytes)
        if why is not None:
            raise UpdateRefused(f"adapter {version.name} does not fit: {why}; nothing was "
                                f"loaded")
        self._generation = version.generation
        self._seen.add(version.name)
        self._versions[version.name] = version
        self._states[version.name] = S.LOADING
        self._record(version, None, S.LOADING, None)

    def move(self, name: str, event: AdapterEvent, *, reason: str = "",
             evidence: tuple[str, ...] = ()) -> AdapterState:
        """One event of an adapter version (``ADAPTER_TRANSITIONS``).

        ``verified`` publishes it: the adapter published before is superseded in
        the same decision, so a reader never sees two current adapters or none.
        ``withdrawn`` leaves none current when it was (the client unloaded it).
        """
        if not isinstance(event, AdapterEvent):
            raise BadInput(f"not an AdapterEvent: {event!r}")
        before = self._states.get(name)
        if before is None:
            raise BadInput(f"no adapter {name!r}")
        after = ADAPTER_TRANSITIONS.get((before, event))
        if after is None:
            raise InvalidTransition(event.value, before.value, "not in ADAPTER_TRANSITIONS")
        if after is S.PUBLISHED:
            self._refuse_if_broken()
        if event is E.UNLOAD and self._bound.get(name):
            raise UpdateRefused(f"adapter {name} still has {self._bound[name]} bound requests")
        version = self._versions[name]
        if after is S.PUBLISHED and self._current is not None:
            old = self._versions[self._current]
            self._states[old.name] = S.STANDBY
            self._record(old, S.PUBLISHED, S.STANDBY, E.SUPERSEDED,
                         f"superseded by {name}")
        self._states[name] = after
        if after is S.PUBLISHED:
            self._current = name
            self._published.append(name)
        if event is E.WITHDRAWN:
            self._withdrawn.add(name)
            if self._current == name:
                self._current = None
        self._record(version, before, after, event, reason, evidence)
        return after

    def admit(self, rollout_id: str) -> AdapterBinding:
        """Bind a request to the current adapter (the base binding is the lifecycle's)."""
        if not isinstance(rollout_id, str) or not rollout_id:
            raise BadInput("rollout_id must be a non-empty string")
        if self._broken is not None:
            raise AdmissionRefused("adapters", f"the adapter table failed closed: "
                                   f"{self._broken}", None)
        if self._current is None:
            raise AdmissionRefused("adapters", "no adapter is published", None)
        if self.unrecorded:
            raise AdmissionRefused("adapters", f"the publish of adapter {self._current} is "
                                   f"being recorded", _RECORDING_RETRY_S)
        if rollout_id in self._rollouts:
            raise BadInput(f"rollout {rollout_id!r} is already bound")
        self._rollouts[rollout_id] = self._current
        self._bound[self._current] = self._bound.get(self._current, 0) + 1
        return AdapterBinding(rollout_id, self._versions[self._current])

    def complete(self, rollout_id: str) -> AdapterVersion:
        name = self._rollouts.pop(rollout_id, None)
        if name is None:
            raise BadInput(f"rollout {rollout_id!r} is not bound to an adapter")
        self._bound[name] -= 1
        if not self._bound[name]:
            del self._bound[name]
        return self._versions[name]

    # ---------------------------------------------------------------- internals
    def _refuse_if_broken(self) -> None:
        if self._broken is not None:
            raise UpdateRefused(f"the adapter table failed closed: {self._broken}")

    def _record(self, v: AdapterVersion, before: AdapterState | None, after: AdapterState,
                event: AdapterEvent | None, reason: str = "",
                evidence: tuple[str, ...] = ()) -> None:
        self._outbox.append(AdapterChange(v.name, v.generation, v.content_digest, v.base,
                                          v.path, before, after, event, reason[:1000],
                                          tuple(str(e)[:1000] for e in evidence)))
