"""Policy versions and weight identities.

Two different questions, two types:

* ``WeightVersion``: *which committed generation is this engine serving?*
  A monotonic ``generation`` (the policy step as RolloutCore publishes it),
  its ``label`` (``rc-3``, what the engine is told through
  ``finish_weight_update``) and the ``engine_epoch`` of the engine process
  that serves it. Generations are comparable across engines: two replicas
  serving generation 3 serve the same policy; the epoch only says which
  process incarnation did, and changes when an engine is replaced.
* ``WeightIdentity``: *which weights was that generation meant to contain?*
  A digest of the parameter manifest (names, shapes, dtypes), the declared
  provenance (checkpoint, trainer run, step), an optional digest of the
  content, and the verification level reached. Two checkpoints of the same
  architecture have the same manifest, so the manifest alone never
  identifies weights: the identity digest folds in provenance and content.

Beside them: the label rule (``check_label``, ``label_for``,
``generation_of``: the one place that says what a label may be and how
``rc-N`` maps to generation N), the one ``Binding`` (a rollout bound to a
version: what the controller hands out on admission and what a trajectory
sample records), and ``EngineIdentity`` (which engine produced a sample),
so adapters and the trajectory share them without importing each other.

Standard library only.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rolloutcore.core.strict import HEX64 as _HEX64
from rolloutcore.core.strict import check_obj, check_str, exact_keys, fail, freeze_json, thaw_json
from rolloutcore.errors import BadInput

__all__ = [
    "LABEL_PREFIX",
    "Binding",
    "EngineIdentity",
    "ParamSpec",
    "ParameterManifest",
    "Provenance",
    "VerificationLevel",
    "WeightIdentity",
    "WeightVersion",
    "check_label",
    "generation_of",
    "label_for",
]

LABEL_PREFIX = "rc-"
#: What a label may be: it travels to vLLM (``finish_weight_update``), into
#: HTTP headers and file names, so no spaces, no slashes, at most 128 characters.
_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
_RC_LABEL = re.compile(rf"^{re.escape(LABEL_PREFIX)}(\d+)$")


def check_label(label: object) -> str:
    """The label rule; every module that takes a label calls this one."""
    if not isinstance(label, str) or not _LABEL_RE.fullmatch(label):
        raise BadInput(f"label must match {_LABEL_RE.pattern}, got {label!r}")
    return label


def label_for(generation: int) -> str:
    """The default label of a generation: ``rc-N``."""
    return f"{LABEL_PREFIX}{generation}"


def generation_of(label: str | None) -> int | None:
    """N for a label ``rc-N`` (an engine an earlier controller labelled), else None."""
    m = _RC_LABEL.fullmatch(label or "")
    return int(m.group(1)) if m else None


def _sha256_json(obj: object) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


@dataclass(frozen=True, order=False)
class WeightVersion:
    """A committed policy generation as served by one engine incarnation."""

    generation: int
    label: str
    engine_epoch: str

    def __post_init__(self) -> None:
        if isinstance(self.generation, bool) or not isinstance(self.generation, int):
            raise BadInput(f"generation must be an int, got {self.generation!r}")
        if self.generation < 0:
            raise BadInput(f"generation must be >= 0, got {self.generation}")
        check_label(self.label)
        if not isinstance(self.engine_epoch, str) or not self.engine_epoch:
            raise BadInput("engine_epoch must be a non-empty string")

    def same_policy(self, other: WeightVersion) -> bool:
        """True when both name the same published generation, on any engine."""
        return self.generation == other.generation and self.label == other.label

    def to_dict(self) -> dict[str, Any]:
        return {"generation": self.generation, "label": self.label,
                "engine_epoch": self.engine_epoch}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> WeightVersion:
        try:
            return cls(int(d["generation"]), str(d["label"]), str(d["engine_epoch"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise BadInput(f"not a WeightVersion: {d!r}") from exc

    def __str__(self) -> str:
        return f"{self.label}@{self.engine_epoch}"


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise BadInput("parameter name must be a non-empty string")
        if not all(isinstance(d, int) and d >= 0 for d in self.shape):
            raise BadInput(f"bad shape for {self.name}: {self.shape!r}")
        if not self.dtype:
            raise BadInput(f"missing dtype for {self.name}")


@dataclass(frozen=True)
class ParameterManifest:
    """Names, shapes and dtypes of a set of parameters, sorted by name."""

    params: tuple[ParamSpec, ...]

    def __post_init__(self) -> None:
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise BadInput("duplicate parameter names in manifest")
        object.__setattr__(self, "params", tuple(sorted(self.params, key=lambda p: p.name)))

    @classmethod
    def from_items(cls, items: Iterable[tuple[str, Iterable[int], str]]) -> ParameterManifest:
        return cls(tuple(ParamSpec(n, tuple(int(x) for x in s), str(d)) for n, s, d in items))

    @functools.cached_property
    def digest(self) -> str:
        # Computed once: the manifest is immutable (a frozen tuple of frozen specs).
        return _sha256_json([[p.name, list(p.shape), p.dtype] for p in self.params])

    def __len__(self) -> int:
        return len(self.params)

    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)


@dataclass(frozen=True)
class Provenance:
    """What the trainer declares the weights to be. Declared, not proven."""

    checkpoint: str
    trainer_run: str = ""
    step: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.checkpoint, str) or not self.checkpoint:
            raise BadInput("provenance.checkpoint must be a non-empty string")
        if not isinstance(self.trainer_run, str):
            raise BadInput("provenance.trainer_run must be a string")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise BadInput(f"provenance.step must be an int >= 0, got {self.step!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint, "trainer_run": self.trainer_run,
                "step": self.step}


class VerificationLevel(enum.IntEnum):
    """How far the identity of served weights was checked, weakest first."""

    DECLARED = 0        # provenance only
    MANIFEST = 1        # names/shapes/dtypes matched the engine's
    ENGINE_CHECKSUM = 2  # engine-side checksums matched a reference (coverage reported)
    PROBE = 3           # the engine computed the target policy on probe inputs

    @property
    def wire(self) -> str:
        return self.name.lower().replace("_", "-")

    @classmethod
    def parse(cls, s: str) -> VerificationLevel:
        for lvl in cls:
            if lvl.wire == s or lvl.name == s:
                return lvl
        raise BadInput(f"unknown verification level {s!r}")


@dataclass(frozen=True)
class WeightIdentity:
    """Which weights a generation was meant to contain, and how well that was checked."""

    manifest_digest: str
    provenance: Provenance
    content_digest: str | None = None
    verification: VerificationLevel = VerificationLevel.DECLARED
    evidence: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.manifest_digest, str) or not _HEX64.fullmatch(self.manifest_digest):
            raise BadInput("manifest_digest must be a sha256 hex digest")
        if self.content_digest is not None and not _HEX64.fullmatch(self.content_digest):
            raise BadInput("content_digest must be a sha256 hex digest or None")
        if not isinstance(self.provenance, Provenance):
            raise BadInput("provenance must be a Provenance")
        if not isinstance(self.verification, VerificationLevel):
            raise BadInput("verification must be a VerificationLevel")

    @classmethod
    def declare(cls, manifest: ParameterManifest, provenance: Provenance,
                content_digest: str | None = None) -> WeightIdentity:
        return cls(manifest.digest, provenance, content_digest)

    @functools.cached_property
    def digest(self) -> str:
        """What the weights *are*: manifest + provenance + content, not the checks.

        Computed once per identity (immutable): every admission records it.
        """
        return _sha256_json({"manifest": self.manifest_digest,
                             "provenance": self.provenance.to_dict(),
                             "content": self.content_digest})

    def same_weights(self, other: WeightIdentity) -> bool:
        return self.digest == other.digest

    def verified(self, level: VerificationLevel, evidence: Iterable[str]) -> WeightIdentity:
        """The same identity with a verification level and a summary of its evidence."""
        return WeightIdentity(self.manifest_digest, self.provenance, self.content_digest,
                              level, tuple(evidence))

    def to_dict(self) -> dict[str, Any]:
        return {"digest": self.digest, "manifest_digest": self.manifest_digest,
                "provenance": self.provenance.to_dict(),
                "content_digest": self.content_digest,
                "verification": self.verification.wire,
                "evidence": list(self.evidence)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> WeightIdentity:
        try:
            p = d["provenance"]
            ident = cls(str(d["manifest_digest"]),
                        Provenance(str(p["checkpoint"]), str(p.get("trainer_run", "")),
                                   int(p.get("step", 0))),
                        d.get("content_digest"),
                        VerificationLevel.parse(str(d.get("verification", "declared"))),
                        tuple(str(e) for e in d.get("evidence", ())))
        except (KeyError, TypeError, AttributeError) as exc:
            raise BadInput(f"not a WeightIdentity: {d!r}") from exc
        if "digest" in d and d["digest"] != ident.digest:
            raise BadInput("WeightIdentity digest does not match its fields")
        return ident


@dataclass(frozen=True)
class Binding:
    """A rollout bound to one committed version: the controller's claim at admission.

    The controller (``LifecycleController.admit``) hands it out; a trajectory
    sample records the same object, so the sample can be matched with the
    journal's ``admit``/``complete`` records by ``rollout_id`` (``None`` when
    the sample was not admitted through a controller). ``admitted_at`` is the
    controller's clock at admission: local bookkeeping, not part of the
    record (``to_dict``) nor of equality.
    """

    version: WeightVersion
    identity: WeightIdentity
    rollout_id: str | None = None
    admitted_at: float | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.version, WeightVersion):
            raise BadInput("binding.version must be a WeightVersion")
        if not isinstance(self.identity, WeightIdentity):
            raise BadInput("binding.identity must be a WeightIdentity")
        if self.rollout_id is not None:
            check_str("binding.rollout_id", self.rollout_id)

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version.to_dict(), "identity": self.identity.to_dict(),
                "rollout_id": self.rollout_id}

    @classmethod
    def from_dict(cls, d: object) -> Binding:
        m = check_obj("binding", d)
        exact_keys("binding", m, ("version", "identity", "rollout_id"))
        try:
            version = WeightVersion.from_dict(check_obj("binding.version", m["version"]))
        except BadInput as exc:
            raise fail("binding.version", str(exc)) from exc
        try:
            identity = WeightIdentity.from_dict(check_obj("binding.identity", m["identity"]))
        except BadInput as exc:
            raise fail("binding.identity", str(exc)) from exc
        return cls(version, identity, m["rollout_id"])


@dataclass(frozen=True)
class EngineIdentity:
    """Which engine produced a sample: vLLM version, served model, relevant config.

    ``config`` holds what changes numerics or replay (dtype, max_model_len,
    logprobs_mode, enable_prefix_caching, tensor_parallel_size, ...);
    ``replica`` names the engine instance (e.g. its base URL) so diversity
    problems can be traced to engines. The adapter builds it, the trajectory
    records it; it lives here so neither imports the other.
    """

    vllm_version: str
    model: str
    config: Mapping[str, Any] = field(default_factory=dict)
    replica: str = ""

    def __post_init__(self) -> None:
        check_str("engine.vllm_version", self.vllm_version)
        check_str("engine.model", self.model)
        if not isinstance(self.replica, str):
            raise BadInput("engine.replica must be a string")
        object.__setattr__(self, "config",
                           freeze_json("engine.config", check_obj("engine.config", self.config)))

    def to_dict(self) -> dict[str, Any]:
        return {"vllm_version": self.vllm_version, "model": self.model,
                "config": thaw_json(self.config), "replica": self.replica}

    @classmethod
    def from_dict(cls, d: object) -> EngineIdentity:
        m = check_obj("engine", d)
        exact_keys("engine", m, ("vllm_version", "model", "config", "replica"))
        return cls(m["vllm_version"], m["model"], m["config"], m["replica"])
