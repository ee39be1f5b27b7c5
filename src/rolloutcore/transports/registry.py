"""Which class answers to which weight-transfer backend name, on each side.

Modelled on vLLM's ``WeightTransferEngineFactory``: a name maps to a lazy
loader (module path, class name), so registering costs no import and a
backend's module (torch, vLLM, CUDA pieces) is imported only where that
backend is used; a name is registered once (a second registration raises,
naming both); an unknown name raises, listing what exists; the built-ins are
registered in one place, at the end of this module.

Two registries, because the two sides never load each other's classes
(vLLM keeps its trainer and worker factories apart for the same reason):

* ``ENGINE_BACKENDS``: the engine halves RolloutCore provides to vLLM,
  installed into vLLM's own factory by ``install_into_vllm`` (what the
  ``vllm.general_plugins`` entry point runs in every vLLM process);
* ``TRAINER_TRANSPORTS``: the trainer-side transports, by the backend name
  the engine is started with (``--weight-transfer-config '{"backend": ...}'``),
  for code that picks a transport by name (``trainer_transport``).

Installing into vLLM has one policy. vLLM calls plugins in every process it
starts, sometimes more than once, and a forked or re-imported process may
find the name already there: the same loader again is a no-op; a name held
by any other class raises ``BackendConflict`` (vLLM would otherwise route
our configuration to a foreign engine).
"""

from __future__ import annotations

import importlib
import re
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from rolloutcore.errors import BadInput

__all__ = [
    "ENGINE_BACKENDS",
    "TRAINER_TRANSPORTS",
    "BackendConflict",
    "BackendRegistry",
    "Loader",
    "install_into_vllm",
    "trainer_transport",
]

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class BackendConflict(BadInput):
    """A backend name is already taken by another class; nothing was registered."""


@dataclass(frozen=True)
class Loader:
    """Where a backend's class lives; ``load`` imports it (only then)."""

    module: str
    attr: str

    def __post_init__(self) -> None:
        for what, v in (("module", self.module), ("class name", self.attr)):
            if not isinstance(v, str) or not _DOTTED.fullmatch(v):
                raise BadInput(f"{what} must be a dotted Python name, got {v!r}")

    @property
    def path(self) -> str:
        return f"{self.module}.{self.attr}"

    def load(self) -> type[Any]:
        obj = getattr(importlib.import_module(self.module), self.attr)
        if not isinstance(obj, type):
            raise BadInput(f"{self.path} is not a class")
        return obj

    def holds(self, cls: object) -> bool:
        """Whether ``cls`` is this loader's class (also after its module was re-imported)."""
        # By name, not identity: a re-imported module makes a new class object, and a
        # module may build its class at first use (gloo does, to import vLLM late).
        return (getattr(cls, "__module__", None), getattr(cls, "__name__", None)) == (
            self.module, self.attr)


class BackendRegistry:
    """Backend name -> ``Loader``, for one side (engine halves or trainer transports)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._loaders: dict[str, Loader] = {}

    def register(self, name: str, module: str, attr: str) -> Loader:
        """Register ``module.attr`` under ``name``; a name already taken raises."""
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise BadInput(f"{self.kind} name must be 1-64 of [A-Za-z0-9_.-], got {name!r}")
        loader = Loader(module, attr)
        have = self._loaders.get(name)
        if have is not None:
            raise BackendConflict(f"{self.kind} {name!r} is already registered to {have.path}; "
                                  f"{loader.path} cannot take it")
        self._loaders[name] = loader
        return loader

    def loader(self, name: str) -> Loader:
        try:
            return self._loaders[name]
        except (KeyError, TypeError):
            raise BadInput(f"unknown {self.kind} {name!r}; registered: "
                           f"{', '.join(self.names()) or 'none'}") from None

    def load(self, name: str) -> type[Any]:
        """The class registered under ``name`` (imported now)."""
        return self.loader(name).load()

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._loaders))

    def items(self) -> Iterator[tuple[str, Loader]]:
        yield from sorted(self._loaders.items())

    def __contains__(self, name: object) -> bool:
        return name in self._loaders

    def __len__(self) -> int:
        return len(self._loaders)


def trainer_transport(name: str, **kwargs: Any) -> Any:
    """A new trainer transport for the engine backend ``name`` (``kwargs`` to its class)."""
    return TRAINER_TRANSPORTS.load(name)(**kwargs)


# What this process installed into each vLLM factory: a repeated install is then a
# no-op that imports nothing (vLLM calls its plugins several times per process).
_installed: weakref.WeakKeyDictionary[Any, dict[str, Loader]] = weakref.WeakKeyDictionary()


def _vllm_factory() -> Any:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    return WeightTransferEngineFactory


def _holder(factory: Any, name: str) -> object:
    """The class vLLM's factory holds under ``name``, or a string saying why it is unknown.

    vLLM has no public lookup; its registry dict is read here, and only when
    ``register_engine`` refused a name this process did not install itself.
    """
    reg = getattr(factory, "_registry", None)
    get = reg.get if isinstance(reg, Mapping) else None
    fn = None if get is None else get(name)
    if not callable(fn):
        return "a backend this vLLM does not let us inspect"
    try:
        return fn()
    except Exception as exc:  # a foreign loader that does not even import
        return f"a backend whose loader fails ({type(exc).__name__}: {exc})"


def install_into_vllm(factory: Any = None, registry: BackendRegistry | None = None
                      ) -> tuple[str, ...]:
    """Register every engine backend into vLLM's ``WeightTransferEngineFactory``.

    Lazily, by module path: vLLM imports a backend's module only in the
    worker that creates that engine. The same loader already there is a
    no-op; a name held by another class raises ``BackendConflict`` naming
    both, and the backends registered before it stay registered (each one is
    correct on its own). Returns the names now installed.
    """
    factory = _vllm_factory() if factory is None else factory
    registry = ENGINE_BACKENDS if registry is None else registry
    done = _installed.setdefault(factory, {})
    for name, loader in registry.items():
        if done.get(name) == loader:
            continue
        try:
            factory.register_engine(name, loader.module, loader.attr)
        except ValueError:  # vLLM: "already registered"
            held = _holder(factory, name)
            if not loader.holds(held):
                what = held if isinstance(held, str) else (
                    f"{getattr(held, '__module__', '?')}.{getattr(held, '__name__', '?')}")
                raise BackendConflict(
                    f"weight transfer backend {name!r} is already registered in vLLM to "
                    f"{what}; RolloutCore's {loader.path} cannot take it") from None
        done[name] = loader
    return tuple(done)


# --------------------------------------------------------------------------- built-ins
# Registered here and nowhere else.

ENGINE_BACKENDS = BackendRegistry("weight transfer engine")
ENGINE_BACKENDS.register("rolloutcore_gloo", "rolloutcore.transports.gloo",
                         "GlooWeightTransferEngine")
ENGINE_BACKENDS.register("rc_cuda_ipc", "rolloutcore.transports.cuda_ipc.engine",
                         "CudaIpcWeightTransferEngine")

TRAINER_TRANSPORTS = BackendRegistry("trainer transport")
TRAINER_TRANSPORTS.register("rolloutcore_gloo", "rolloutcore.transports.gloo", "GlooTransport")
TRAINER_TRANSPORTS.register("nccl", "rolloutcore.transports.nccl", "NcclTransport")
TRAINER_TRANSPORTS.register("ipc", "rolloutcore.transports.ipc", "IpcTransport")
TRAINER_TRANSPORTS.register("rc_cuda_ipc", "rolloutcore.transports.cuda_ipc.trainer",
                            "CudaIpcTransport")
