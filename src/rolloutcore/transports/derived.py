"""Derived copies of written weights: find them before an update, rebuild them after.

Why this exists. A vLLM layer may keep, besides its parameter, state derived
from it once at load time (its quant method's ``process_weights_after_loading``).
On the CPU backend every unquantized linear and embedding layer builds the
GEMM it runs (``layer.cpu_linear``) there: a closure over a packed copy of
the weight (sgl kernel, AMX hosts), over a oneDNN handle holding a reordered
copy (oneDNN: float32 on any x86 host that has it, bfloat16/float16 only
with AVX-512), over a zentorch prepack (Zen hosts with zentorch), or plain
``F.linear`` on the live weight (every other case, e.g. bfloat16 on an AVX2
host). vLLM's layerwise reload re-runs that processing for each layer it
loads a weight into, so loaded layers stay exact. A layer that *shares* a
parameter with another one is never loaded: with tied embeddings
``lm_head.weight is model.embed_tokens.weight``, the checkpoint and the
loader name only the embedding, and the reload puts ``lm_head``'s old
tensors back untouched. Its ``cpu_linear`` then still multiplies by the old
packed copy: the label says the new policy, the logits are the old one's.

What this module does, free of vLLM (duck-typed on ``quant_method``):

* ``plan_rederive(model)``, before anything is written: every group of
  modules that hold one storage (``tied_groups``), and for each member
  whether its derived state can be rebuilt exactly. Rebuildable is a quant
  method in ``REDERIVABLE``: its processing rebuilds everything from the
  intact weight and leaves the weight as it is, so running it again is
  idempotent and gives what a cold load gives. A member with any other quant
  method is refused (``NotRederivable``): the update never starts.
* ``rederive(model, plan, written)``, after the update's own processing:
  checks that each group still shares one storage (a reload that untied it
  is refused: ``NotExact``), then re-runs the processing of every rebuildable
  member of each group whose storage the update wrote.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

from rolloutcore.errors import BadInput, RolloutCoreError

__all__ = [
    "REDERIVABLE",
    "NotExact",
    "NotRederivable",
    "RederivePlan",
    "Sharer",
    "TiedGroup",
    "plan_rederive",
    "rederive",
    "tied_groups",
]

#: Quant methods whose ``process_weights_after_loading`` derives its state from the
#: weight alone and never changes the weight: re-running it after the weight was
#: written gives exactly what a cold load gives. vLLM's ``UnquantizedEmbeddingMethod``
#: calls ``dispatch_cpu_unquantized_gemm(layer, remove_weight=False)`` on the CPU
#: backend (a new packed copy / oneDNN handle / prepack from ``layer.weight``; the sgl
#: path also casts a bias to float32, idempotent) and nothing elsewhere.
#: ``UnquantizedLinearMethod`` is *not* here: on packing hosts it replaces the weight
#: by an empty tensor (``remove_weight=True``), so it cannot run twice.
REDERIVABLE = frozenset({"UnquantizedEmbeddingMethod"})


class NotRederivable(BadInput):
    """A module shares a written weight and its derived state cannot be rebuilt exactly."""


class NotExact(RolloutCoreError, RuntimeError):
    """After an update, a derived copy cannot be shown to hold the new weights.

    Raised inside vLLM's worker at finish (so also a ``RuntimeError``, as vLLM's
    weight-transfer engines raise): the finish fails and the label is not set.
    """


@dataclass(frozen=True)
class Sharer:
    """One module holding a shared storage: its name, its parameter, its quant method."""

    module: str
    param: str
    method: str | None

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.param}" if self.module else self.param


@dataclass(frozen=True)
class TiedGroup:
    """Modules whose parameters are one storage (first member: first in module order)."""

    members: tuple[Sharer, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(m.qualname for m in self.members)


@dataclass(frozen=True)
class RederivePlan:
    """What ``rederive`` will rebuild after an update (``plan_rederive`` checked it)."""

    groups: tuple[TiedGroup, ...]

    @property
    def rederived(self) -> tuple[Sharer, ...]:
        return tuple(m for g in self.groups for m in g.members if m.method in REDERIVABLE)

    def describe(self) -> list[str]:
        return [" = ".join(g.names) for g in self.groups]


def _storage_key(t: Any) -> tuple[str, int] | None:
    """Where a tensor's bytes live; None for tensors that hold none (meta, empty)."""
    if t is None or getattr(t, "is_meta", False) or t.numel() == 0:
        return None
    try:
        return (str(t.device), int(t.untyped_storage().data_ptr()))
    except (RuntimeError, ValueError):  # e.g. an uninitialized parameter
        return None


def _owned(model: Any) -> Iterator[tuple[str, str, Any, Any]]:
    """(module name, parameter name, module, parameter) for every parameter a module holds
    directly, aliases included (``named_parameters`` would drop them)."""
    for mname, mod in model.named_modules(remove_duplicate=False):
        for pname, p in mod._parameters.items():
            if p is not None:
                yield mname, pname, mod, p


def _method_name(mod: Any) -> str | None:
    qm = getattr(mod, "quant_method", None)
    return None if qm is None else type(qm).__name__


def tied_groups(model: Any) -> list[TiedGroup]:
    """Every storage held by more than one module, in module order.

    Keyed by storage, not by parameter object: a view of another parameter's
    bytes is a shared weight as much as the same ``Parameter`` is.
    """
    by_key: dict[tuple[str, int], dict[int, Sharer]] = {}
    for mname, pname, mod, p in _owned(model):
        key = _storage_key(p)
        if key is None:
            continue
        # One module reached under two names is one holder: keep its first name.
        by_key.setdefault(key, {}).setdefault(id(mod), Sharer(mname, pname, _method_name(mod)))
    return [TiedGroup(tuple(g.values())) for g in by_key.values() if len(g) > 1]


def plan_rederive(model: Any) -> RederivePlan:
    """Check, before an update writes anything, that every shared weight can be exact.

    Raises ``NotRederivable`` naming the module, the weight it shares and its
    quant method when a member of a tied group derives state that cannot be
    rebuilt exactly (a member with no quant method derives nothing at load time
    and reads the weight live).
    """
    groups = tuple(tied_groups(model))
    for g in groups:
        for m in g.members:
            if m.method is not None and m.method not in REDERIVABLE:
                raise NotRederivable(
                    f"{m.module or '<model>'} shares the weight {' = '.join(g.names)} and its "
                    f"quant method {m.method} derives state from it that a hot update cannot "
                    f"rebuild exactly (rebuildable: {sorted(REDERIVABLE)}); this engine "
                    "refuses hot weight updates of this model: restart it on the new "
                    "checkpoint instead")
    return RederivePlan(groups)


def rederive(model: Any, plan: RederivePlan,
             written: Collection[str] | None = None) -> list[str]:
    """Rebuild the derived state of every shared weight the update wrote.

    ``written``: the qualified names of the parameters the update wrote (any
    alias of a group counts for the whole group); None rebuilds every group.
    Returns the modules rebuilt. Raises ``NotExact`` when a group no longer
    shares one storage (the reload untied it: one side would serve other
    weights than the other) or a planned module is gone. Only the planned
    modules are visited: a model without tied weights costs nothing here.
    """
    done: list[str] = []
    for g in plan.groups:
        keys = set()
        mods: list[Any] = []
        for m in g.members:
            try:
                mod = model.get_submodule(m.module) if m.module else model
            except AttributeError as exc:
                raise NotExact(f"{m.module} is gone from the model after the update") from exc
            keys.add(_storage_key(mod._parameters.get(m.param)))
            mods.append(mod)
        if len(keys) != 1 or None in keys:
            raise NotExact(f"{' = '.join(g.names)} no longer share one storage after the "
                           "update: the tied weight cannot be shown to be the new one")
        if written is not None and not set(g.names) & set(written):
            continue
        for m, mod in zip(g.members, mods, strict=True):
            if m.method in REDERIVABLE:
                mod.quant_method.process_weights_after_loading(mod)
                done.append(m.module)
    return done
