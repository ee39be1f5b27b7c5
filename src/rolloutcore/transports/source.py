"""What the trainer sends: one view over a module, a state dict or a checkpoint.

Every transport and every identity check needs the same three things from
the trainer's weights: the parameter manifest (names, shapes, dtypes), the
tensors one at a time in a fixed order, and a digest of the content. A
``WeightSource`` gives them for the three forms a trainer holds weights in,
without copying a module's parameters (a checkpoint is read lazily, one
tensor at a time).

Order: tensors come out sorted by name, the order of
``ParameterManifest.params``, so a receiver told the manifest up front can
check every tensor it gets against the next entry.

Dtypes are spelled as torch spells them without the ``torch.`` prefix
(``"bfloat16"``), which is also what vLLM's weight-transfer update info
carries (``dtype_names``).
"""

from __future__ import annotations

import hashlib
import operator
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from rolloutcore.core.versions import ParameterManifest
from rolloutcore.errors import BadInput

if TYPE_CHECKING:
    import torch

__all__ = ["WeightSource", "Weights", "dtype_name"]

#: What an update takes as weights (``WeightSource.of``): a module, a state dict of
#: tensors, a safetensors checkpoint directory, or a source.
Weights: TypeAlias = "WeightSource | torch.nn.Module | Mapping[str, torch.Tensor] | str | Path"


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (memoized: it runs once per tensor per pass)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).rsplit(".", 1)[-1]
    return name


_Entry = tuple[str, tuple[int, ...], str]

_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")


class WeightSource:
    """A re-iterable, ordered stream of named tensors with its manifest and digest.

    Build it with ``from_module``, ``from_state_dict``, ``from_checkpoint``
    or ``WeightSource.of(obj)``. Bad input raises ``BadInput`` at build
    time; nothing is read from disk or device until asked.
    """

    def __init__(self, entries: list[_Entry],
                 loader: Callable[[], Iterator[tuple[str, torch.Tensor]]],
                 description: str, *, immutable: bool = False) -> None:
        if not entries:
            raise BadInput(f"{description}: no tensors")
        names = [e[0] for e in entries]
        if len(set(names)) != len(names):
            raise BadInput(f"{description}: duplicate tensor names")
        self._entries = sorted(entries, key=lambda e: e[0])
        self._loader = loader
        self.description = description
        self._manifest = ParameterManifest.from_items(self._entries)
        # Only a checkpoint on disk is treated as immutable; a module or a state
        # dict changes under our feet between training steps, so its digest is
        # recomputed on every call.
        self._immutable = immutable
        self._digest: str | None = None
        # A state dict's own tensors, in manifest order (``checked_tensors``), and the
        # manifest's shapes and dtypes as lists to compare them with in one pass.
        self._fixed: tuple[tuple[str, ...], list[torch.Tensor]] | None = None
        self._expect: tuple[list[tuple[int, ...]], list[Any]] | None = None

    # -- constructors -------------------------------------------------------

    @classmethod
    def of(cls, obj: Weights) -> WeightSource:
        """A source from a module, a state dict, a checkpoint directory or a source."""
        if isinstance(obj, WeightSource):
            return obj
        if isinstance(obj, (str, Path)):
            return cls.from_checkpoint(obj)
        if isinstance(obj, Mapping):
            return cls.from_state_dict(obj)
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - torch is a vllm dependency
            raise BadInput("torch is required for a weight source") from exc
        if isinstance(obj, torch.nn.Module):
            return cls.from_module(obj)
        raise BadInput(f"not a weight source: {type(obj).__name__} (expected a "
                       "torch.nn.Module, a state dict or a safetensors checkpoint dir)")

    @classmethod
    def from_module(cls, module: object) -> WeightSource:
        """The module's parameters (tied ones once), by their ``named_parameters`` names."""
        import torch

        if not isinstance(module, torch.nn.Module):
            raise BadInput(f"not a torch.nn.Module: {type(module).__name__}")
        params = dict(module.named_parameters())
        return cls.from_state_dict(params, description=f"module {type(module).__name__}")

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], *,
                        description: str = "state dict") -> WeightSource:
        """The mapping's tensors; the mapping is read again on every iteration."""
        import torch

        if not isinstance(state, Mapping):
            raise BadInput(f"not a mapping: {type(state).__name__}")
        entries: list[_Entry] = []
        for name, t in state.items():
            if not isinstance(name, str) or not name:
                raise BadInput(f"{description}: tensor names must be non-empty strings, "
                               f"got {name!r}")
            if not isinstance(t, torch.Tensor):
                raise BadInput(f"{description}: {name} is a {type(t).__name__}, not a tensor")
            if t.is_sparse or t.layout != torch.strided:
                raise BadInput(f"{description}: {name} is not a dense tensor")
            entries.append((name, tuple(int(d) for d in t.shape), dtype_name(t.dtype)))
        snapshot = dict(state)
        order = sorted(snapshot)

        def load() -> Iterator[tuple[str, torch.Tensor]]:
            for name in order:
                t = snapshot[name]
                # detach() only where there is a graph to cut: it allocates a new
                # tensor object each time (2 ms for 399 tensors on the update path).
                yield name, (t.detach() if t.requires_grad else t)

        src = cls(entries, load, description)
        src._fixed = (tuple(order), [snapshot[n] for n in order])
        return src

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> WeightSource:
        """The tensors of every ``*.safetensors`` file in a checkpoint directory."""
        d = Path(path)
        if not d.is_dir():
            raise BadInput(f"{d} is not a directory")
        files = sorted(d.glob("*.safetensors"))
        if not files:
            raise BadInput(f"{d} holds no *.safetensors file")
        from safetensors import safe_open

        where: dict[str, Path] = {}
        entries: list[_Entry] = []
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as fh:
                    for name in fh.keys():  # noqa: SIM118 - safe_open is not a Mapping
                        if name in where:
                            raise BadInput(f"{d}: {name} is in both {where[name].name} "
                                           f"and {f.name}")
                        where[name] = f
                        sl = fh.get_slice(name)
                        entries.append((name, tuple(int(x) for x in sl.get_shape()),
                                        _ST_DTYPES.get(sl.get_dtype(), sl.get_dtype())))
            except BadInput:
                raise
            except Exception as exc:
                raise BadInput(f"{f} is not a readable safetensors file: {exc}") from exc

        def load() -> Iterator[tuple[str, torch.Tensor]]:
            handles: dict[Path, Any] = {}
            try:
                for name in sorted(where):
                    f = where[name]
                    if f not in handles:
                        handles[f] = safe_open(str(f), framework="pt")
                    yield name, handles[f].get_tensor(name)
            finally:
                handles.clear()

        return cls(entries, load, f"checkpoint {d}", immutable=True)

    # -- views --------------------------------------------------------------

    def manifest(self) -> ParameterManifest:
        return self._manifest

    @property
    def immutable(self) -> bool:
        """A checkpoint on disk: its content digest is computed once and kept."""
        return self._immutable

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """A fresh pass over ``(name, tensor)`` in manifest order, checked against it.

        A state dict or module that changed shape since the source was built
        raises ``BadInput`` instead of sending something the receiver was not
        told about.
        """
        specs = iter(self._entries)
        for name, t in self._loader():
            want = next(specs, None)
            got = (name, tuple(t.shape), dtype_name(t.dtype))
            if want != got:
                raise BadInput(f"{self.description}: tensor {got} does not match "
                               f"its manifest entry {want}")
            yield name, t
        if next(specs, None) is not None:
            raise BadInput(f"{self.description}: fewer tensors than its manifest")

    def checked_tensors(self) -> tuple[tuple[str, ...], list[torch.Tensor]] | None:
        """A state dict's ``(names, tensors)`` in manifest order, checked as
        ``named_tensors`` checks them; ``None`` for any other source.

        The names are the snapshot's (fixed when the source was built); every
        tensor's current shape and dtype are compared with its manifest entry in
        a few C-level passes, not one Python step per tensor, so the hot path's
        zero-copy test costs about the same for 399 tensors as for one. A
        mismatch raises ``BadInput`` exactly as ``named_tensors`` does (it is
        run to say which entry). The tensors are the mapping's own objects,
        not detached: for reading their layout (``PackedWeights.holds_tensors``),
        not for sending.
        """
        fixed = self._fixed
        if fixed is None:
            return None
        exp = self._expect
        if exp is None:
            import torch

            exp = self._expect = ([s for _, s, _ in self._entries],
                                  [getattr(torch, d) for _, _, d in self._entries])
        ts = fixed[1]
        if list(map(_SHAPE, ts)) != exp[0] or list(map(_DTYPE, ts)) != exp[1]:
            for _ in self.named_tensors():  # raises BadInput naming the entry
                pass
        return fixed

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.named_tensors()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (what a transfer moves), from the manifest."""
        import torch

        total = 0
        for _, shape, dt in self._entries:
            n = 1
            for d in shape:
                n *= d
            total += n * getattr(torch, dt).itemsize
        return total

    def content_digest(self) -> str:
        """sha256 over every (name, shape, dtype, raw bytes) in order.

        Two sources with the same digest hold the same bytes under the same
        names: this is what ``WeightIdentity.content_digest`` records.
        """
        if self._digest is None or not self._immutable:
            import torch

            h = hashlib.sha256()
            for name, t in self.named_tensors():
                raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                header = f"{name}\0{list(t.shape)}\0{dtype_name(t.dtype)}\0".encode()
                h.update(struct.pack("<Q", len(header)))
                h.update(header)
                h.update(struct.pack("<Q", raw.numel()))
                h.update(raw.numpy().tobytes())
            self._digest = h.hexdigest()
        return self._digest

    def __repr__(self) -> str:
        return f"WeightSource({self.description}, {len(self)} tensors, {self.nbytes} bytes)"


# safetensors header dtype -> torch dtype name
_ST_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32",
    "I64": "int64", "F16": "float16", "BF16": "bfloat16", "F32": "float32",
    "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "U16": "uint16", "U32": "uint32", "U64": "uint64",
}
