"""Where a checkpoint tensor may land in an engine's model (the gloo receiver's index).

``ModelIndex`` places checkpoint names on a model's parameters (whole, or
shards of fused ones) with the model's own ``packed_modules_mapping`` and
``hf_to_vllm_mapper``; ``check_against_model`` refuses a round the model
cannot take before a byte is received. Used by the engine half of
``rolloutcore_gloo`` (``transports.gloo``), which re-exports both.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["LOADER_RENAMES", "ModelIndex", "RoundMetadata", "check_against_model"]

#: Floating dtypes that convert exactly as a cold load converts them (``copy_``) into a
#: floating parameter; any other dtype must equal the parameter's.
_FLOAT_WIRE = frozenset({"bfloat16", "float16", "float32", "float64"})


class RoundMetadata(Protocol):
    """A round's tensor metadata, in send order (``gloo.GlooUpdateInfo``)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


def _dim_bound(shape: Any, module: Any, param: Any) -> tuple[int, ...]:
    """The largest tensor a cold load could copy into ``param``: its own shape, times the
    module's tensor-parallel degree along a sharded dimension (the checkpoint holds the
    whole tensor, each worker its shard)."""
    bound = [int(d) for d in shape]
    tp = getattr(module, "tp_size", 1)
    tp = tp if isinstance(tp, int) and not isinstance(tp, bool) and tp > 1 else 1
    if tp > 1:
        for attr in ("output_dim", "input_dim"):
            d = getattr(param, attr, None)
            if isinstance(d, int) and 0 <= d < len(bound):
                bound[d] *= tp
    return tuple(bound)


@dataclass(frozen=True)
class _Slot:
    """Where a checkpoint tensor may land: a parameter, whole (``parts`` empty) or the
    shards ``parts`` of a fused one."""

    param: str
    parts: tuple[int, ...]
    bound: tuple[int, ...]
    dtype: str
    floating: bool


@dataclass(frozen=True)
class _Fused:
    odim: int
    sizes: tuple[int, ...]
    slot: _Slot  # the whole parameter

    def shard(self, parts: tuple[int, ...]) -> _Slot:
        b = self.slot.bound
        size = sum(self.sizes[i] for i in parts)  # output_sizes are whole (unsharded)
        return dataclasses.replace(self.slot, parts=parts,
                                   bound=(*b[:self.odim], size, *b[self.odim + 1:]))


_QKV_SHARDS = {"q": 0, "k": 1, "v": 2}  # vLLM's QKVParallelLinear shard ids


def _under_model(name: str) -> str:
    """``EagleLlamaForCausalLM.load_weights`` (vllm/model_executor/models/llama_eagle.py):
    every checkpoint name but the output projection's moves under ``model.``."""
    return name if "lm_head" in name else "model." + name


#: What a model class's own ``load_weights`` does to a checkpoint name before vLLM's
#: loader and ``hf_to_vllm_mapper`` see it (read in vLLM 0.32's model files).
LOADER_RENAMES: dict[str, Callable[[str], str]] = {"EagleLlamaForCausalLM": _under_model}

#: Class names of vLLM's speculative heads (EAGLE-1/3, MTP, DFlash, Medusa, ...), whose
#: loaders rename, skip or transform checkpoint names.
_SPECULATOR = re.compile(r"Eagle|MTP|DFlash|DSpark|Medusa|MLPSpeculator")


class ModelIndex:
    """What a round may write into one model, taken while its tensors are real.

    Built before the layerwise reload opens (the reload swaps parameters for
    meta tensors and unties tied ones), then used for every round of the
    session: ``resolve`` places a checkpoint name on ``_Slot``s.

    A layer's live parameters are not always what a load writes: on the CPU
    backend a packed linear layer keeps an empty ``weight`` (its GEMM holds
    the packed copy). ``layout(module)``, when given, returns the module's
    model-format tensors (vLLM's reload metadata, meta tensors with the
    shapes, dtypes and attributes a load writes); those are used where they
    exist, the live parameters elsewhere.

    A checkpoint name goes through what the model's own ``load_weights`` does
    to it before vLLM's loader sees it (``LOADER_RENAMES``, by class: an EAGLE
    head moves its names under ``model.``), then its ``hf_to_vllm_mapper``. A
    speculative head whose renaming is not known here (in a draft round, a
    class of ``_SPECULATOR``'s names not in the table: EAGLE-3, MTP, DFlash,
    ...) takes no name: a name the check accepts and the loader refuses would
    fail with the reload open. ``shared_with``: the model whose
    tensors this one borrows (vLLM's EAGLE draft shares the target's embedding
    and output projection); a name landing on a borrowed tensor is refused, as
    only the target's own round writes it.
    """

    def __init__(self, model: Any,
                 layout: Callable[[Any], Mapping[str, Any] | None] | None = None,
                 elsewhere: Sequence[str] = (), shared_with: Any = None) -> None:
        #: Module prefixes (``"model.layers.1."``) another pipeline stage holds: vLLM's
        #: ``get_pp_missing_layer_names`` of this stage's model.
        self.elsewhere = tuple(str(e) for e in elsewhere)
        packed: Mapping[str, Any] = getattr(model, "packed_modules_mapping", None) or {}
        self.packed = {k: tuple(v) for k, v in packed.items()}
        self.direct: dict[str, _Slot] = {}
        self.fused: dict[str, _Fused] = {}
        canonical: dict[int, str] = {}
        self.aliases: dict[str, str] = {}
        theirs = ({id(t) for t in shared_with.parameters()} if shared_with is not None
                  else set())
        #: Parameters that are ``shared_with``'s tensors (by identity).
        self.borrowed: set[str] = set()
        cls = type(model).__name__
        self.rename = LOADER_RENAMES.get(cls)
        # A speculative head in a draft round whose loader's renaming is not known. (A
        # target is never refused by name: Eagle2_5_VL is a vision-language target.)
        self.unknown_loader = (cls if shared_with is not None and self.rename is None
                               and _SPECULATOR.search(cls) else None)
        for mname, mod in model.named_modules():
            live = {k: v for k, v in mod._parameters.items() if v is not None}
            fmt = (layout(mod) if layout is not None else None) or {}
            for pname in dict.fromkeys([*live, *fmt]):
                n = f"{mname}.{pname}" if mname else pname
                p = live.get(pname)
                if p is not None:
                    first = canonical.setdefault(id(p), n)
                    if first != n:
                        self.aliases[n] = first
                        continue
                key = self._add(n, mod, fmt.get(pname, p))
                if p is not None and id(p) in theirs:
                    self.borrowed.add(key)
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        self.map_shard = getattr(mapper, "_map_name_with_shard", None)
        self.map_name = getattr(mapper, "_map_name", None)

    def _add(self, n: str, mod: Any, t: Any) -> str:
        slot = _Slot(n, (), _dim_bound(t.shape, mod, t), str(t.dtype).rsplit(".", 1)[-1],
                     bool(t.dtype.is_floating_point))
        # An engine started with --enable-lora wraps its layers: the checkpoint's
        # ``x.weight`` is ``x.base_layer.weight`` there (vLLM's own reload strips it too).
        key = n.replace(".base_layer.", ".")
        self.direct[key] = slot
        sizes = getattr(mod, "output_sizes", None)
        if isinstance(sizes, (list, tuple)) and len(sizes) > 1:
            odim = getattr(t, "output_dim", 0)
            odim = odim if isinstance(odim, int) and 0 <= odim < len(slot.bound) else 0
            self.fused[key] = _Fused(odim, tuple(int(x) for x in sizes), slot)
        return key

    def _mapped(self, name: str) -> tuple[str, Any]:
        """The model's own renaming: (parameter name, shard id or None)."""
        if self.unknown_loader is not None:
            raise ValueError(
                f"{name}: this model is a {self.unknown_loader}, whose load_weights renames "
                f"checkpoint names in a way not known here (known: "
                f"{', '.join(sorted(LOADER_RENAMES))}); nothing is sent to it")
        if self.rename is not None:
            name = self.rename(name)
        if callable(self.map_shard):
            r = self.map_shard(name)
            if r is None:
                raise ValueError(f"{name}: this model's loader drops that name")
            return str(r[0]), r[1]
        if callable(self.map_name):
            m = self.map_name(name)
            if not isinstance(m, str):
                raise ValueError(f"{name}: this model's loader drops that name")
            return m, None
        return name, None

    def _shards(self, name: str, target: str, shard: Any) -> list[_Slot]:
        f = self.fused.get(target)
        if f is None:
            raise ValueError(f"{name}: maps to shard {shard!r} of {target}, which is not a "
                             "fused parameter of this model")
        groups = shard if isinstance(shard, list) else [shard]
        out = []
        for g in groups:
            ids = g if isinstance(g, tuple) else (g,)
            idx = [_QKV_SHARDS.get(i, i) if isinstance(i, str) else i for i in ids]
            ok = [i for i in idx if isinstance(i, int) and not isinstance(i, bool)
                  and 0 <= i < len(f.sizes)]
            if not ok or len(ok) != len(idx):
                raise ValueError(f"{name}: shard {shard!r} of {target} is not one of its "
                                 f"{len(f.sizes)} shards")
            out.append(f.shard(tuple(ok)))
        return out

    def owned_elsewhere(self, name: str) -> bool:
        """``name`` belongs to a layer another pipeline stage holds (vLLM's
        ``is_pp_missing_parameter`` on the model's own name for it): this stage skips it.
        A name the model's loader drops is not another stage's (``resolve`` refuses it)."""
        if not self.elsewhere:
            return False
        try:
            target, _ = self._mapped(name)
        except ValueError:
            return False
        return any(target.startswith(e) for e in self.elsewhere)

    def split(self, names: Sequence[str]) -> tuple[list[str], list[str]]:
        """(this stage's names, the names another stage holds), in round order."""
        mine: list[str] = []
        other: list[str] = []
        for n in names:
            (other if self.owned_elsewhere(n) else mine).append(n)
        return mine, other

    def resolve(self, name: str) -> list[_Slot]:
        slots = self._resolve(name)
        for slot in slots:
            if slot.param in self.borrowed:
                raise ValueError(f"{name}: lands on {slot.param}, which this model shares "
                                 "with the engine's target model; only the target's own "
                                 "round writes it")
        return slots

    def _resolve(self, name: str) -> list[_Slot]:
        target, shard = self._mapped(name)
        if target in self.aliases:
            raise ValueError(f"{name}: tied to {self.aliases[target]} in this engine; send "
                             f"the shared weight once, as {self.aliases[target]}")
        if shard is not None:
            return self._shards(name, target, shard)
        slot = self.direct.get(target)
        if slot is not None:
            return [slot]
        dotted = "." + target
        for fused, parts in self.packed.items():
            for i, part in enumerate(parts):
                tag = f".{part}."
                if tag in dotted:
                    f = self.fused.get(dotted.replace(tag, f".{fused}.", 1)[1:])
                    if f is not None and len(f.sizes) == len(parts):
                        return [f.shard((i,))]
        raise ValueError(f"{name}: not a parameter of this model nor a shard of one of its "
                         "fused parameters")


def check_against_model(info: RoundMetadata, model: Any) -> set[str]:
    """Refuse a round the engine's model cannot take; return the parameters it writes.

    ``model``: the model, or its ``ModelIndex``. Every name must place on the
    model: a parameter, or the shard of a fused parameter the model's
    ``packed_modules_mapping`` names (``q_proj`` of ``qkv_proj``), after the
    model's own ``hf_to_vllm_mapper`` if it has one. A name that is an alias of
    a tied parameter is refused (send the shared weight once, under its first
    name: a cold load skips the alias, a hot one would write the storage
    twice). No two names may land on one target. Each shape must have the
    target's rank and fit it (``_dim_bound``), each dtype convert to it.
    Anything else raises ``ValueError`` naming the tensor: the round allocates
    at most what the model itself holds.
    """
    index = model if isinstance(model, ModelIndex) else ModelIndex(model)
    seen: dict[str, dict[int, str]] = {}  # parameter -> shard (-1: whole) -> name
    written: set[str] = set()
    for name, dt, shape in zip(info.names, info.dtype_names, info.shapes, strict=True):
        slots = index.resolve(name)
        for slot in slots:
            taken = seen.setdefault(slot.param, {})
            wants = slot.parts or (-1,)
            clash = [taken[i] for i in (*wants, -1) if i in taken] or (
                list(taken.values()) if not slot.parts else [])
            if clash:
                raise ValueError(f"{name} and {clash[0]} both land on {slot.param}")
            if len(shape) != len(slot.bound) or any(
                    d > b for d, b in zip(shape, slot.bound, strict=True)):
                raise ValueError(f"{name}: shape {shape} does not fit {slot.param} "
                                 f"(at most {list(slot.bound)} here)")
            if not (dt == slot.dtype or (slot.floating and dt in _FLOAT_WIRE)):
                raise ValueError(f"{name}: dtype {dt} does not convert exactly to "
                                 f"{slot.param}'s {slot.dtype}")
        for slot in slots:
            seen[slot.param].update(dict.fromkeys(slot.parts or (-1,), name))
            written.add(slot.param)
    return written
