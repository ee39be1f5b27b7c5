"""The answer to ``POST /control/adapters``, read once, at the client's edge.

One shape, for a gateway over one engine and for a fleet's. An engine's
*acknowledgement* is what ``AdapterResult.to_dict`` says::

    {"version": {"generation", "name", "path", "content_digest", "base", "size_bytes"},
     "checks": [Check.to_dict(), ...], "phases": {name: seconds},
     "retired": [name, ...], "notes": [text, ...], "base_verified": bool}

A gateway over one engine answers exactly that. A fleet answers the same
fields for the fleet, and more: its ``version`` has no ``path`` and no
``base`` (each replica read its own copy, verified on the base it serves),
and names the replicas it was published on (``version.replicas``); its
``checks`` are the replicas' merged (one per name: passed only where every
replica passed it, the largest difference) plus ``acknowledged``;
``members`` are the serving replicas the update went to, ``not_serving``
the others; ``replicas`` maps each member to its own acknowledgement, in
the one-engine shape above. So one parser reads both (``parse_adapter_answer``):
the per-replica acknowledgements, or the answer itself as the one engine's
(replica ``""``).

What is accepted as published is checked here, not trusted: every member
acknowledged (the fleet publishes only then), every acknowledgement names
the same version (generation, name, content, size; the name is the one that
generation and content give) and passed every check it lists, among them
``listed``, ``content`` and ``adapter-probe``. Anything else is ``BadInput``
naming the field; the client turns it into an ambiguous ``UpdateFailed``
(the gateway said 200, what it published is not known).

Standard library and ``core`` only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from rolloutcore.core.adapters import AdapterVersion, adapter_name
from rolloutcore.core.evidence import Check
from rolloutcore.core.strict import check_obj, exact_keys, fail
from rolloutcore.core.versions import VerificationLevel
from rolloutcore.errors import BadInput

__all__ = ["REQUIRED_CHECKS", "AdapterAck", "PublishedAdapter", "merged_checks",
           "parse_adapter_answer"]

#: The checks every engine's acknowledgement must list, passed (``base-probe`` too,
#: unless the engine says it skipped it: ``base_verified`` false).
REQUIRED_CHECKS = ("listed", "content", "adapter-probe")

_ACK_KEYS = ("version", "checks", "phases")
_ACK_OPTIONAL = ("retired", "notes", "base_verified")
_FLEET_KEYS = ("members", "not_serving", "replicas")


@dataclass(frozen=True)
class AdapterAck:
    """One engine's acknowledgement of an adapter version: loaded, verified, published.

    ``replica``: the fleet's name for the engine (``""``: a gateway's one engine);
    ``version``: the version as that engine holds it (its path, the label of the
    base it was verified on)."""

    replica: str
    version: AdapterVersion
    checks: tuple[Check, ...]
    phases: Mapping[str, float] = field(default_factory=dict)
    retired: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    base_verified: bool = True

    def __post_init__(self) -> None:
        where = f"replicas.{self.replica}" if self.replica else "answer"
        if not isinstance(self.version, AdapterVersion):
            raise fail(f"{where}.version", "must be an AdapterVersion")
        failed = [c.name for c in self.checks if not c.passed]
        if failed:
            raise fail(f"{where}.checks", f"{', '.join(failed)} did not pass: not published")
        names = {c.name for c in self.checks}
        missing = [n for n in REQUIRED_CHECKS if n not in names]
        if missing:
            raise fail(f"{where}.checks", f"no {', '.join(missing)} check: not verified")
        if self.base_verified != ("base-probe" in names):
            raise fail(f"{where}.base_verified", f"says {self.base_verified}, the checks "
                       f"{'list' if 'base-probe' in names else 'do not list'} a base-probe")

    @property
    def probe_max_abs_diff(self) -> float | None:
        return next((c.max_abs_diff for c in self.checks if c.name == "adapter-probe"), None)

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version.to_dict(), "checks": [c.to_dict() for c in self.checks],
                "phases": dict(self.phases), "retired": list(self.retired),
                "notes": list(self.notes), "base_verified": self.base_verified}


@dataclass(frozen=True)
class PublishedAdapter:
    """An adapter version a gateway published, with every engine's acknowledgement.

    ``acks`` by replica (``{"": ack}`` for a gateway over one engine); ``fleet``:
    whether a fleet answered (``members``: the replicas it had to be acknowledged by,
    all of them; ``not_serving``: the fleet's others, outside the pool then)."""

    generation: int
    name: str
    content_digest: str
    size_bytes: int
    acks: Mapping[str, AdapterAck]
    phases: Mapping[str, float] = field(default_factory=dict)
    fleet: bool = False
    not_serving: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.acks:
            raise fail("replicas", "no engine acknowledged it: not published")
        if self.name != adapter_name(self.generation, self.content_digest):
            raise fail("version.name", f"{self.name!r} is not the name generation "
                       f"{self.generation} and content {self.content_digest[:16]} give")
        if self.fleet != ("" not in self.acks):
            raise fail("replicas", "a fleet's acknowledgements are each a named replica's, "
                       "a gateway's one engine's is unnamed")
        if not self.fleet and len(self.acks) != 1:
            raise fail("replicas", "one engine, one acknowledgement")
        head = (self.generation, self.name, self.content_digest, self.size_bytes)
        for n, a in self.acks.items():
            if a.replica != n:
                raise fail(f"replicas.{n}", f"is replica {a.replica!r}'s acknowledgement")
            v = a.version
            if (v.generation, v.name, v.content_digest, v.size_bytes) != head:
                raise fail(f"replicas.{n}.version", f"{v.name} (generation {v.generation}, "
                           f"sha256 {v.content_digest[:16]}, {v.size_bytes} bytes) is not "
                           f"the published {self.name} (generation {self.generation}, "
                           f"sha256 {self.content_digest[:16]}, {self.size_bytes} bytes)")
        if set(self.not_serving) & set(self.acks):
            raise fail("not_serving", "names a replica that acknowledged it")

    @property
    def replicas(self) -> tuple[str, ...]:
        return tuple(sorted(self.acks))

    @property
    def probe_max_abs_diff(self) -> float | None:
        """The largest difference of the probe through the adapter, on any engine."""
        ds = [d for a in self.acks.values() if (d := a.probe_max_abs_diff) is not None]
        return max(ds) if ds else None


# --------------------------------------------------------------------------- writing

def merged_checks(acks: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A fleet's ``checks``: every replica's acknowledgement (``to_dict`` shape) merged by
    check name, in first-seen order: passed only where every replica listed it passed,
    the largest difference, each replica's detail."""
    order: list[str] = []
    by: dict[str, list[tuple[str, Mapping[str, Any]]]] = {}
    for n in sorted(acks):
        for c in acks[n].get("checks") or ():
            if c["name"] not in by:
                order.append(c["name"])
                by[c["name"]] = []
            by[c["name"]].append((n, c))
    out = []
    for name in order:
        got = by[name]
        diffs = [c["max_abs_diff"] for _, c in got if c.get("max_abs_diff") is not None]
        tols = {c.get("tolerance") for _, c in got}
        levels = {c.get("level") for _, c in got}
        out.append({"name": name,
                    "passed": len(got) == len(acks) and all(c["passed"] is True for _, c in got),
                    "detail": "; ".join(f"{n}: {c.get('detail', '')}" for n, c in got),
                    "coverage": None, "max_abs_diff": max(diffs) if diffs else None,
                    "tolerance": tols.pop() if len(tols) == 1 else None,
                    "level": levels.pop() if len(levels) == 1 else None})
    return out


# --------------------------------------------------------------------------- reading

def parse_adapter_answer(data: object) -> PublishedAdapter:
    """The gateway's 200 answer to ``POST /control/adapters`` (module docstring), checked;
    ``BadInput`` naming the field for anything that does not say one version published
    on every engine it went to."""
    m = check_obj("answer", data)
    if "replicas" not in m:
        ack = _ack("", m)
        v = ack.version
        return PublishedAdapter(v.generation, v.name, v.content_digest, v.size_bytes,
                                MappingProxyType({"": ack}), ack.phases)
    exact_keys("answer", m, (*_ACK_KEYS, *_FLEET_KEYS), _ACK_OPTIONAL)
    ver = check_obj("version", m["version"])
    exact_keys("version", ver, ("generation", "name", "content_digest", "size_bytes",
                                "replicas"), ("provenance",))
    members = _names("members", m["members"])
    published = _names("version.replicas", ver["replicas"])
    reps = check_obj("replicas", m["replicas"])
    if not members:
        raise fail("members", "no replica: nothing was published")
    if set(published) != set(members) or set(reps) != set(members):
        raise fail("replicas", f"the update went to {sorted(members)}, the version names "
                   f"{sorted(published)} and {sorted(reps)} acknowledged it: a fleet's "
                   f"version is published only when every one did")
    acks = {n: _ack(n, check_obj(f"replicas.{n}", reps[n])) for n in sorted(reps)}
    checks = _checks("checks", m["checks"])
    ack_check = next((c for c in checks if c.name == "acknowledged"), None)
    if ack_check is None or not ack_check.passed:
        raise fail("checks", "no passed 'acknowledged' check: not published on every member")
    failed = [c.name for c in checks if not c.passed]
    if failed:
        raise fail("checks", f"{', '.join(failed)} did not pass: not published")
    gen, name, digest, size = (ver["generation"], ver["name"], ver["content_digest"],
                               ver["size_bytes"])
    for k, x in (("generation", gen), ("size_bytes", size)):
        if isinstance(x, bool) or not isinstance(x, int):
            raise fail(f"version.{k}", f"must be an int, got {x!r}")
    if not isinstance(name, str) or not isinstance(digest, str):
        raise fail("version", "name and content_digest must be strings")
    return PublishedAdapter(gen, name, digest, size, MappingProxyType(acks),
                            _phases("phases", m["phases"]), True,
                            tuple(_names("not_serving", m["not_serving"])))


def _ack(replica: str, m: Mapping[str, Any]) -> AdapterAck:
    where = f"replicas.{replica}" if replica else "answer"
    if "error" in m:
        raise fail(where, f"reports an error: {str(m['error'])[:300]}")
    exact_keys(where, m, _ACK_KEYS, _ACK_OPTIONAL)
    v = m["version"]
    check_obj(f"{where}.version", v)
    try:
        version = AdapterVersion.from_dict(v)
    except BadInput as exc:
        raise fail(f"{where}.version", str(exc)) from exc
    base_verified = m.get("base_verified", True)
    if not isinstance(base_verified, bool):
        raise fail(f"{where}.base_verified", f"must be a bool, got {base_verified!r}")
    return AdapterAck(replica, version, _checks(f"{where}.checks", m["checks"]),
                      _phases(f"{where}.phases", m["phases"]),
                      tuple(_strs(f"{where}.retired", m.get("retired", ()))),
                      tuple(_strs(f"{where}.notes", m.get("notes", ()))), base_verified)


def _checks(where: str, xs: object) -> tuple[Check, ...]:
    if not isinstance(xs, Sequence) or isinstance(xs, (str, bytes)):
        raise fail(where, "must be a list of checks")
    out = []
    for i, x in enumerate(xs):
        c = check_obj(f"{where}[{i}]", x)
        exact_keys(f"{where}[{i}]", c, ("name", "passed"),
                   ("detail", "coverage", "max_abs_diff", "tolerance", "level"))
        nums = {k: c.get(k) for k in ("coverage", "max_abs_diff", "tolerance")}
        for k, v in nums.items():
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not math.isfinite(v)):
                raise fail(f"{where}[{i}].{k}", f"must be a finite number or null, got {v!r}")
        if not isinstance(c["name"], str) or not isinstance(c["passed"], bool) or \
                not isinstance(c.get("detail", ""), str):
            raise fail(f"{where}[{i}]", "name and detail must be strings, passed a bool")
        lvl = c.get("level")
        try:
            level = None if lvl is None else VerificationLevel.parse(str(lvl))
            cov, diff, tol = (None if v is None else float(v) for v in nums.values())
            out.append(Check(c["name"], c["passed"], c.get("detail", ""), cov, diff, tol,
                             level))
        except (BadInput, ValueError) as exc:
            raise fail(f"{where}[{i}]", str(exc)) from exc
    return tuple(out)


def _phases(where: str, x: object) -> Mapping[str, float]:
    m = check_obj(where, x)
    out = {}
    for k, v in m.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or v < 0:
            raise fail(f"{where}.{k}", f"must be seconds (a finite number >= 0), got {v!r}")
        out[str(k)] = float(v)
    return MappingProxyType(out)


def _strs(where: str, xs: object) -> list[str]:
    if not isinstance(xs, Sequence) or isinstance(xs, (str, bytes)) or \
            not all(isinstance(x, str) for x in xs):
        raise fail(where, "must be a list of strings")
    return list(xs)


def _names(where: str, xs: object) -> list[str]:
    out = _strs(where, xs)
    if any(not x for x in out) or len(set(out)) != len(out):
        raise fail(where, "replica names must be non-empty and distinct")
    return out
