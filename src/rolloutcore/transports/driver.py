"""Driving vLLM's own trainer engines (NCCL, CUDA IPC) as ``WeightTransport``s.

vLLM ships the trainer half of its GPU backends: ``WeightTransferTrainerFactory
.trainer_init(init_info, client=..., source=...)`` returns an engine whose
``send_weights()`` runs the whole round (start, update, finish) through a
``VLLMWeightSyncClient``. RolloutCore does not reimplement any of it; it adds
the three guards the seed found missing, around it:

* **Target-aware finish** (``TargetAwareSyncClient``). vLLM's trainer engines
  call ``client.finish_weight_update()`` with no version. The wrapper is given
  the pending target label before ``send_weights()`` and supplies it in that
  finalize call; with no target set it refuses to finish at all, so an
  update can never complete unlabelled. It also records how far the round
  got, which is what classifies a failure (did ``/start_weight_update`` go
  out?).
* **Same CUDA device** (``DeviceGuard``). PyTorch's current CUDA device is
  per thread, and the NCCL/IPC producers use streams of the current device:
  a transfer started from a thread on another device fails obscurely
  ("Cuda failure 400: invalid resource handle") or touches the wrong GPU.
  The device is recorded at init; a send from a thread whose current device
  differs is refused before anything is sent, and the side thread that runs
  ``send_weights`` is set to the recorded device explicitly.
* **Identity preflight.** The target's manifest digest is compared with the
  source's before the first engine call.

Everything vLLM- or CUDA-specific is imported lazily or injected, so this
module imports, and its logic is tested, on a machine without either.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from rolloutcore.core.evidence import TransferEvidence
from rolloutcore.core.strict import check_int
from rolloutcore.engine.errors import is_refusal
from rolloutcore.errors import BadInput, RolloutCoreError, TransferError
from rolloutcore.transports.base import (
    TransportBase,
    check_label,
    check_timeout,
    check_url,
    preflight,
    remaining,
    run_side,
)
from rolloutcore.transports.source import WeightSource

if TYPE_CHECKING:
    import torch

__all__ = [
    "DeviceGuard",
    "SourceSlot",
    "TargetAwareSyncClient",
    "VllmTrainerTransport",
    "cuda_current_device",
    "cuda_set_device",
]


# ------------------------------------------------------------------ target-aware finish


class TargetAwareSyncClient:
    """A ``VLLMWeightSyncClient`` that finishes with the pending target label.

    ``inner`` is any object with vLLM's four sync-client methods (vLLM's own
    ``HTTPVLLMWeightSyncClient`` by default in the drivers). The wrapper
    also keeps the round's progress: ``start_state`` is ``"none"`` until
    ``start_weight_update`` is called, ``"sent"`` while it is in flight,
    ``"accepted"`` or ``"refused"`` (the engine said no: 4xx, or it could
    not be reached) afterwards.
    """

    def __init__(self, inner: Any) -> None:
        for m in ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                  "finish_weight_update"):
            if not callable(getattr(inner, m, None)):
                raise BadInput(f"sync client lacks {m}()")
        self.inner = inner
        self._pending: str | None = None
        self.start_state = "none"
        self.finished_label: str | None = None

    def set_target(self, label: str) -> None:
        """The label the next finalize call must carry; resets the round's progress."""
        self._pending = check_label(label)
        self.start_state = "none"
        self.finished_label = None

    def clear_target(self) -> None:
        self._pending = None

    @property
    def mutation_possible(self) -> bool:
        """Whether the engine's weights may have changed in this round."""
        return self.start_state in ("sent", "accepted")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.inner.init_weight_transfer_engine(init_info)

    def shutdown_weight_transfer_engine(self) -> None:
        fn = getattr(self.inner, "shutdown_weight_transfer_engine", None)
        if callable(fn):
            fn()

    def start_weight_update(self) -> None:
        if self._pending is None:
            raise TransferError("transfer", "start_weight_update: no target was set on the "
                                "sync client", mutation_started=False)
        self.start_state = "sent"
        try:
            self.inner.start_weight_update()
        except BaseException as exc:
            if _is_refusal(exc):
                self.start_state = "refused"
            raise
        self.start_state = "accepted"

    def update_weights(self, update_info: Any) -> None:
        self.inner.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        label = self._pending
        if label is None:
            raise TransferError("finish_weight_update", "no target was set on the sync "
                                "client", mutation_started=True)
        if weight_version is not None and weight_version != label:
            raise TransferError("finish_weight_update", f"asked to finish as "
                                f"{weight_version!r} while the target is {label!r}",
                                mutation_started=True)
        self.inner.finish_weight_update(weight_version=label)
        self.finished_label = label


def _is_refusal(exc: BaseException) -> bool:
    """The engine said no to a request (4xx) or was never reached."""
    if isinstance(exc, RolloutCoreError):  # our own engine.errors mapping
        return is_refusal(exc)
    resp = getattr(exc, "response", None)  # requests.HTTPError, httpx.HTTPStatusError
    status = getattr(resp, "status_code", None)
    if isinstance(status, int):
        return 400 <= status < 500
    name = type(exc).__name__
    return name in ("ConnectionError", "ConnectError") and resp is None


# ------------------------------------------------------------------ device guard


def cuda_current_device() -> int:
    import torch

    return int(torch.cuda.current_device())


def cuda_set_device(index: int) -> None:
    import torch

    torch.cuda.set_device(index)


class DeviceGuard:
    """Records the CUDA device at init and refuses use from a thread on another one."""

    def __init__(self, get_device: Callable[[], int] = cuda_current_device,
                 set_device: Callable[[int], None] = cuda_set_device) -> None:
        self._get = get_device
        self._set = set_device
        self.device: int | None = None

    def bind(self) -> int:
        self.device = int(self._get())
        return self.device

    def check(self) -> int:
        """The bound device, if this thread's current device is it; else TransferError."""
        if self.device is None:
            raise TransferError("transfer", "not initialised: connect() first",
                                mutation_started=False)
        here = int(self._get())
        if here != self.device:
            raise TransferError(
                "transfer", f"this thread's current CUDA device is {here}, but the transfer "
                f"was initialised on device {self.device}; call "
                f"torch.cuda.set_device({self.device}) in this thread first",
                mutation_started=False)
        return self.device

    def enter(self, device: int) -> None:
        """In a side thread: make ``device`` current (the current device is per thread)."""
        self._set(device)


# ------------------------------------------------------------------ source slot


class SourceSlot:
    """The source handed to vLLM's trainer engine at init, refilled for every send.

    vLLM's full-resync engines take their ``WeightSource`` once, at
    ``trainer_init``, and replay it on every ``send_weights()``; RolloutCore
    sends a different source each round. The slot holds the round's source
    and moves tensors to the transfer device when they are not on it.
    ``as_vllm()`` presents it as a vLLM ``WeightSource`` (a subclass of vLLM's
    class, so built only when vLLM is there).
    """

    def __init__(self) -> None:
        self.source: WeightSource | None = None
        self.device: Any = None
        self._views: list[Any] = []

    def fill(self, source: WeightSource, device: Any) -> None:
        self.source = source
        self.device = device
        for view in self._views:  # a 0.33+ view caches the metadata: forget it
            view.__dict__.pop("metadata", None)

    def specs(self) -> list[tuple[str, Any, tuple[int, ...]]]:
        """(name, torch dtype, shape) of every tensor, in send order."""
        import torch

        return [(p.name, getattr(torch, p.dtype), tuple(p.shape))
                for p in self._src().manifest().params]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._src().named_tensors():
            if self.device is not None and t.device != self.device:
                t = t.to(self.device)
            yield name, t

    def _src(self) -> WeightSource:
        if self.source is None:
            raise TransferError("transfer", "no source for this round", mutation_started=False)
        return self.source

    def as_vllm(self) -> Any:
        """This slot as a ``vllm.distributed.weight_transfer.base.WeightSource``.

        vLLM 0.26-0.32 call ``metadata()`` and iterate the source; from 0.33
        ``metadata`` is a ``functools.cached_property`` (checked when the class
        is defined) and engines call ``iter_full()``. The cached metadata is
        dropped whenever the slot is refilled, so each round declares its own
        source (a 0.33+ trainer then sends the round's metadata again rather
        than an empty "unchanged" round).
        """
        from vllm.distributed.weight_transfer import base

        # Typed as Any: the class differs by version, and mypy sees the installed one.
        VllmSource: Any = base.WeightSource
        ParamMeta: Any = base.ParamMeta
        slot = self

        def metas() -> list[Any]:
            return [ParamMeta(n, d, s) for n, d, s in slot.specs()]

        view: Any
        if isinstance(VllmSource.__dict__.get("metadata"), property):
            class _Slot033(VllmSource):  # type: ignore[misc]
                @functools.cached_property
                def metadata(self) -> list[Any]:
                    return metas()

                def iter_full(self) -> Iterator[tuple[str, Any]]:
                    return iter(slot)

            view = _Slot033()
        else:
            class _Slot(VllmSource):  # type: ignore[misc]
                def metadata(self) -> list[Any]:
                    return metas()

                def __iter__(self) -> Iterator[tuple[str, Any]]:
                    return iter(slot)

            view = _Slot()
        self._views.append(view)
        return view


# ------------------------------------------------------------------ the driver


class VllmTrainerTransport(TransportBase):
    """A ``WeightTransport`` over one of vLLM's trainer engines.

    Subclasses say which backend and which init info (``nccl``, ``ipc``).
    ``trainer_init`` and ``client_factory`` default to vLLM's factory and
    its HTTP sync client; tests inject others. An injected ``trainer_init``
    is called as ``trainer_init(info, client=..., source=SourceSlot)``.
    """

    backend = ""

    def __init__(self, *, guard: DeviceGuard | None = None,
                 trainer_init: Callable[..., Any] | None = None,
                 client_factory: Callable[[str, float], Any] | None = None,
                 engine_world_size: int | None = None) -> None:
        super().__init__()
        self.guard = guard or DeviceGuard()
        self._trainer_init = trainer_init
        self._client_factory = client_factory
        if engine_world_size is not None:
            check_int("engine_world_size", engine_world_size, 1)
        self._engine_ws = engine_world_size
        self._slot = SourceSlot()
        self._engine: Any = None
        self._client: TargetAwareSyncClient | None = None
        self._url: str | None = None

    # -- subclass hooks -----------------------------------------------------------

    def init_info(self, base_url: str, engine_world_size: int) -> Any:
        raise NotImplementedError

    def engine_config(self) -> dict[str, Any]:
        return {"backend": self.backend}

    def engine_env(self) -> dict[str, str]:
        """Environment the engine needs for this backend (none by default)."""
        return {}

    def torch_device(self, index: int) -> Any:
        import torch

        return torch.device("cuda", index)

    # -- connect --------------------------------------------------------------------

    @property
    def connected_to(self) -> str | None:
        return self._url

    def _connect(self, url: str, deadline: float) -> None:
        self._drop()
        device = self.guard.bind()
        ws = self._engine_ws or self.engine_world_size(url, deadline)
        info = self.init_info(url, ws)
        client = TargetAwareSyncClient(self._make_client(url, remaining(deadline)))
        source = self._slot
        trainer_init = self._trainer_init or _factory_trainer_init

        def init() -> Any:
            self.guard.enter(device)
            return trainer_init(info, client=client, source=source)

        f = run_side(init, f"{self.backend}-init")
        self.wait([f], deadline, "init_weight_transfer_engine", mutation_started=False)
        self._engine, self._client, self._url = f.result(), client, url

    def _make_client(self, url: str, timeout_s: float) -> Any:
        if self._client_factory is not None:
            return self._client_factory(url, timeout_s)
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        return HTTPVLLMWeightSyncClient(url, timeout=timeout_s)

    # -- send -----------------------------------------------------------------------

    def send(self, base_url: str, target_label: str, source: WeightSource, *,
             timeout_s: float, expected_manifest_digest: str | None = None
             ) -> TransferEvidence:
        """One round through vLLM's trainer engine, finished with ``target_label``.

        Refused before any engine call (``mutation_started=False``): bad
        arguments, a failed identity preflight, a thread on another CUDA
        device, not connected to ``base_url``.
        """
        url = check_url(base_url)
        label = check_label(target_label)
        t = check_timeout(timeout_s)
        preflight(source, expected_manifest_digest)
        device = self.guard.check()
        if self._url != url or self._engine is None or self._client is None:
            raise TransferError("transfer", f"not connected to {url}: connect() first",
                                mutation_started=False)
        t0 = time.monotonic()
        self._enter()
        engine, client = self._engine, self._client
        try:
            client.set_target(label)
            self._slot.fill(source, self.torch_device(device))

            def run() -> None:
                self.guard.enter(device)
                engine.send_weights()

            f = run_side(run, f"{self.backend}-send")
            try:
                self.wait([f], t0 + t, "send_weights", mutation_started=True)
            except TransferError as exc:
                # Abort, deadline or failure: how far did the round get?
                possible = client.mutation_possible
                if possible:
                    self._drop()  # the group may hold a pending collective
                raise TransferError("transfer", exc.reason,
                                    mutation_started=possible) from exc
            if client.finished_label != label:
                raise TransferError("transfer", f"send_weights returned without finishing "
                                    f"as {label!r}", mutation_started=True)
            return TransferEvidence(completed=True, mutation_started=True,
                                    backend=self.backend, tensors=len(source),
                                    bytes=source.nbytes, finish_label=label,
                                    elapsed_s=time.monotonic() - t0)
        finally:
            client.clear_target()
            self._busy = False

    # -- teardown -------------------------------------------------------------------

    def abort(self) -> None:
        """From another thread: make ``send`` return, and tear the collective down.

        vLLM's trainer engines destroy their communicator in ``shutdown()``
        (for NCCL, ``PyNcclCommunicator.destroy``, i.e. ``ncclCommAbort``),
        which is what frees a broadcast blocked on a dead peer. Without it the
        caller gets its typed error but the blocked thread (and its kernel)
        would stay behind.
        """
        engine = self._engine
        super().abort()
        self._drop()
        if engine is not None:
            f = run_side(engine.shutdown, f"{self.backend}-abort")
            with contextlib.suppress(Exception):  # best effort; the caller is already free
                f.result(timeout=5.0)

    def _drop(self) -> None:
        """Forget the engine without touching it: it may be blocked in a collective."""
        self._engine, self._client, self._url = None, None, None

    def close(self) -> None:
        """Shut the trainer engine down, and ask the inference side to release its end."""
        engine, client = self._engine, self._client
        self._drop()
        if engine is not None and not self._abort.is_set():
            with contextlib.suppress(Exception):  # best effort: nothing depends on it
                engine.shutdown()
            if client is not None:
                f = run_side(client.shutdown_weight_transfer_engine, "shutdown")
                with contextlib.suppress(Exception):
                    f.result(timeout=5.0)


def _factory_trainer_init(info: Any, *, client: Any, source: SourceSlot) -> Any:
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    return WeightTransferTrainerFactory.trainer_init(info, client=client,
                                                     source=source.as_vllm())
