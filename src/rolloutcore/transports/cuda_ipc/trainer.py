"""The trainer half of ``rc_cuda_ipc``: one shared buffer, and the update session.

The trainer keeps its weights in ONE contiguous device buffer
(``PackedWeights``, module ``packed``, re-exported here; a module can be
re-based onto it, the way a flat parameter is) and shares that buffer
through a single IPC handle, created once and reused for every update
(``share_buffer``). ``CudaIpcTransport`` runs vLLM's update session with
the JSON handle body and, where the engine has no version label (vLLM
0.26), gathers the version evidence: the workers' block checksum of what
the update wrote, read from a small trainer-owned device buffer the
workers fill at finish (``ResultSlot``), or asked through
``/collective_rpc``; compared with the trainer's own checksum of what it
sent by ``verification.checksums.compare``.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rolloutcore.core.evidence import Check, TransferEvidence
from rolloutcore.core.versions import VerificationLevel
from rolloutcore.engine.routes import Routes
from rolloutcore.engine.weight_sync import HttpWeightSync
from rolloutcore.errors import BadInput, EffectError, EngineUnavailable, TransferError
from rolloutcore.transports.cuda_ipc.checksum import (
    CHECKSUM_IMPLS,
    checksum_digest,
)
from rolloutcore.transports.cuda_ipc.loader import COPY_IMPLS
from rolloutcore.transports.cuda_ipc.packed import PackedWeights, share_buffer
from rolloutcore.transports.cuda_ipc.wire import (
    BACKEND,
    HASH_AT_FINISH,
    MODES,
    PROTOCOL,
    RESULT_ROUTES,
    RESULTS,
    ROW_COUNT,
    ROW_HEADER,
    ROW_NAMES,
    ROW_NONCE,
    ROW_UNCOVERED,
    WORKER_EXTENSION,
    BufferHandle,
    ResultSlot,
    UpdateMessage,
    encode_update,
    names_digest,
    names_digest60,
)
from rolloutcore.verification.checksums import compare

__all__ = ["CudaIpcTransport", "PackedWeights", "SendTimings", "engine_flags", "share_buffer"]


def engine_flags() -> list[str]:
    """``vllm serve`` flags that select this backend and its worker extension."""
    return ["--weight-transfer-config", json.dumps({"backend": BACKEND}),
            "--worker-extension-cls", WORKER_EXTENSION]


@dataclass
class SendTimings:
    start_s: float = 0.0
    update_s: float = 0.0
    finish_s: float = 0.0
    pack_s: float = 0.0
    trainer_checksum_s: float = 0.0


class CudaIpcTransport:
    """Trainer side of ``rc_cuda_ipc``: a RolloutCore weight transport.

    ``send`` runs vLLM's update session (``/start_weight_update``,
    ``/update_weights`` with the JSON handle body, ``/finish_weight_update``)
    and passes the target's label to the finish when the engine has weight
    versions (read from its ``/openapi.json``: vLLM 0.26 has none, and then
    the label is not sent and the evidence says so). It also computes the
    trainer's own checksum of what it sent (``last_sent_checksum``), which
    ``engine_checksum`` compares against the workers' one.
    """

    backend = BACKEND

    def __init__(self, *, mode: str = "fast", device: torch.device | str = "cuda",
                 compute_checksum: bool = True, copy_impl: str = "auto",
                 checksum_impl: str = "auto", hash_at_finish: bool = False,
                 checksum_results: str = "ipc", results_wait_s: float = 2.0) -> None:
        if checksum_results not in RESULT_ROUTES:
            raise BadInput(f"checksum_results must be one of {RESULT_ROUTES}")
        if isinstance(results_wait_s, bool) or not isinstance(results_wait_s, (int, float)) \
                or not 0 < results_wait_s <= 600:
            raise BadInput("results_wait_s must be a number of seconds in (0, 600]")
        if mode not in MODES:
            raise BadInput(f"mode must be one of {MODES}")
        if copy_impl not in COPY_IMPLS:
            raise BadInput(f"copy_impl must be one of {COPY_IMPLS}")
        if checksum_impl not in CHECKSUM_IMPLS:
            raise BadInput(f"checksum_impl must be one of {CHECKSUM_IMPLS}")
        self.mode = mode
        self.copy_impl = copy_impl
        self.checksum_impl = checksum_impl
        # (engine URL, layout digest) pairs the engine has accepted in full since
        # connect(): later updates of that layout name it instead of listing it.
        self._delivered: set[tuple[str, str]] = set()
        self.device = torch.device(device)
        self.compute_checksum = compute_checksum
        #: ask the workers to hash the updated slices inside /finish_weight_update
        #: (the finish then takes the hash's time; the check only collects values).
        #: Off by default: VllmAdapter starts the check as the transfer returns,
        #: beside the cache reset, which costs the paused window less.
        self.hash_at_finish = hash_at_finish
        #: how the workers' checksum comes back: ``ipc``, written by the workers at
        #: finish into a small buffer of the trainer's (no round trip while the
        #: engine is paused; ``rpc`` is asked if it is not there within
        #: ``results_wait_s``); ``rpc``, asked through ``/collective_rpc``.
        self.checksum_results = checksum_results
        self.results_wait_s = float(results_wait_s)
        self._ranks: dict[str, list[int]] = {}
        self._slot: tuple[torch.Tensor, BufferHandle] | None = None
        self._expect: tuple[ResultSlot, str] | None = None
        self._read_stream: Any = None
        self._syncs: dict[str, HttpWeightSync] = {}  # engine -> its weight-sync client
        self._lock = threading.Lock()
        self._staging: PackedWeights | None = None
        self._routes: frozenset[str] = frozenset()
        self.label_supported = False
        self.last_timings = SendTimings()
        self.last_sent_checksum: list[int] = []
        self.last_sent_names: tuple[str, ...] = ()
        self._msg_cache: tuple[PackedWeights, str, UpdateMessage] | None = None
        self._adopted: list[PackedWeights] = []
        self.last_zero_copy = False
        self._pre: tuple[PackedWeights, list[int], tuple[str, ...]] | None = None
        self.last_check: dict[str, Any] = {}
        self._names_cache: tuple[tuple[str, ...], str] | None = None
        self._digest_cache: tuple[tuple[str, ...], list[int], str,
                                  dict[str, int]] | None = None
        self._n_params: dict[str, int] = {}   # engine parameters per worker, from hello
        #: engines this transport has written to since their last connect(): only
        #: those have a write for validation_check to compare
        self._sent_to: set[str] = set()
        self._last_check_url: str | None = None

    def precompute_checksum(self, packed: PackedWeights, *,
                            values: Sequence[int] | None = None) -> float:
        """Checksum ``packed`` now (at staging, outside the engine's pause window).

        The next ``send`` of this buffer uses it instead of hashing again; the
        buffer must not change in between, and if it does the engine's
        checksum will not match and the paused validation fails (fail-closed).
        ``values``: the checksum already computed (one per entry, by this
        transport's ``checksum_impl``), as a fan-out hashes once for every
        engine. Returns the seconds it took.
        """
        if not isinstance(packed, PackedWeights):
            raise BadInput("precompute_checksum() takes a PackedWeights")
        t = time.monotonic()
        if values is None:
            vals = packed.checksum(self.checksum_impl)
        else:
            vals = list(values)
            if len(vals) != len(packed.entries) or not all(
                    isinstance(v, int) and not isinstance(v, bool) for v in vals):
                raise BadInput("values must be one integer checksum per entry")
        self._pre = (packed, vals, packed.names())
        # The digests the validation compares with, made now (staging) rather than
        # in the paused window: the send hands these very objects to the check.
        self._digests(packed.names(), vals)
        return time.monotonic() - t

    def stage(self, source: Any) -> PackedWeights:
        """The buffer a ``send`` of ``source`` would share: an adopted one as is (no
        copy), else this transport's staging buffer, filled now."""
        return self._packed(source, SendTimings())

    def adopt(self, packed: PackedWeights) -> None:
        """Register a trainer buffer: a source whose tensors are its views is sent as is."""
        if not isinstance(packed, PackedWeights):
            raise BadInput("adopt() takes a PackedWeights")
        if packed not in self._adopted:
            self._adopted.append(packed)

    # -- RolloutCore transport interface ---------------------------------------

    def engine_config(self) -> dict[str, Any]:
        """What the engine must be started with (flags) for this transport."""
        return {"backend": BACKEND, "flags": engine_flags(),
                "weight_transfer_config": {"backend": BACKEND},
                "worker_extension_cls": WORKER_EXTENSION}

    def connect(self, base_url: str, *, timeout_s: float = 30.0) -> dict[str, Any]:
        """Check the engine offers the update session, init the backend, say hello."""
        self._check_url(base_url)
        paths = self._sync(base_url).routes(timeout_s=timeout_s, step="connect")
        need = {Routes.INIT_TRANSFER, Routes.START_UPDATE, Routes.UPDATE_WEIGHTS,
                Routes.FINISH_UPDATE, Routes.COLLECTIVE_RPC}
        if not need <= paths:
            raise EngineUnavailable("connect", f"engine lacks routes {sorted(need - paths)}",
                                    mutation_started=False)
        self._routes = paths
        # Weight versions came with /update_weight_version and /weight_info; a finish
        # body with weight_version is read only where those exist (not in 0.26).
        self.label_supported = Routes.WEIGHT_INFO in paths and Routes.UPDATE_WEIGHT_VERSION in paths
        self._delivered = {d for d in self._delivered if d[0] != base_url}
        self._sent_to.discard(base_url)
        self._sync(base_url).init_weight_transfer_engine(
            {"protocol": PROTOCOL, "copy_impl": self.copy_impl,
             "checksum_impl": self.checksum_impl}, timeout_s=timeout_s, step="connect")
        hello = self.rpc(base_url, "rc_cuda_ipc_hello", timeout_s=timeout_s)
        uuid = str(torch.cuda.get_device_properties(self.device).uuid) \
            if self.device.type == "cuda" else ""
        ranks = sorted(h.get("rank", -1) if isinstance(h, dict) else -1 for h in hello)
        self._ranks[base_url] = ranks if ranks == list(range(len(hello))) else []
        for h in hello:
            if not isinstance(h, dict) or h.get("backend") != BACKEND:
                raise EngineUnavailable("connect", f"worker is not running {BACKEND}: {h!r}",
                                        mutation_started=False)
            if uuid and h.get("device_uuid") != uuid:
                raise EngineUnavailable("connect", f"worker GPU {h.get('device_uuid')} is not "
                                        f"the trainer's {uuid}: CUDA IPC needs one host GPU",
                                        mutation_started=False)
        counts = {h.get("n_params") for h in hello}
        n = counts.pop() if len(counts) == 1 else None
        if isinstance(n, int) and n > 0:
            self._n_params[base_url] = n
        else:
            self._n_params.pop(base_url, None)
        return {"label_supported": self.label_supported, "workers": hello}

    def send(self, base_url: str, target_label: str, source: Any, *,
             timeout_s: float = 300.0) -> TransferEvidence:
        """One update session. ``source``: a PackedWeights, or (name, tensor) pairs."""
        self._check_url(base_url)
        if not isinstance(target_label, str) or not target_label:
            raise BadInput("target_label must be a non-empty string")
        t0 = time.monotonic()
        tm = SendTimings()
        packed = self._packed(source, tm)
        msg = self._message(packed)
        delivered = (base_url, msg.layout_digest)
        body = encode_update(msg, by_reference=delivered in self._delivered)
        if self.compute_checksum and self.hash_at_finish:
            body[HASH_AT_FINISH] = True
        self._expect = None
        slot = self._result_slot(base_url, len(msg.entries))
        if slot is not None:
            body[RESULTS] = slot.to_json()
        mutation = False
        try:
            if packed.device.type == "cuda":
                torch.cuda.synchronize(packed.device)  # the engine reads after our writes
            t = time.monotonic()
            sync = self._sync(base_url)
            sync.start_weight_update(timeout_s=timeout_s, step="transfer")
            tm.start_s = time.monotonic() - t
            mutation = True
            t = time.monotonic()
            sync.update_weights(body, timeout_s=timeout_s, step="transfer")
            tm.update_s = time.monotonic() - t
            self._delivered.add(delivered)
            self._sent_to.add(base_url)
            pre, self._pre = self._pre, None
            if pre is not None and pre[0] is packed:
                self.last_sent_checksum, self.last_sent_names = pre[1], pre[2]
            elif self.compute_checksum:
                t = time.monotonic()
                self.last_sent_checksum = packed.checksum(self.checksum_impl)
                self.last_sent_names = packed.names()
                tm.trainer_checksum_s = time.monotonic() - t
            t = time.monotonic()
            sync.finish_weight_update(target_label if self.label_supported else None,
                                      timeout_s=timeout_s, step="transfer")
            tm.finish_s = time.monotonic() - t
            if slot is not None:
                self._expect = (slot, base_url)
        except EffectError as exc:  # a TransferError, or the call's (engine.errors)
            raise TransferError("transfer", exc.reason, mutation_started=mutation) from exc
        self.last_timings = tm
        unverified: tuple[str, ...] = ()
        if not self.label_supported:
            unverified = ("engine has no weight_version: the label was not passed through "
                          "finish_weight_update",)
        return TransferEvidence(
            completed=True, mutation_started=True, backend=BACKEND,
            tensors=len(packed.entries), bytes=packed.nbytes,
            finish_label=target_label if self.label_supported else None,
            elapsed_s=time.monotonic() - t0, unverified=unverified)

    def abort(self) -> None:
        """From another thread: make a stuck HTTP call return (closes the connection pools)."""
        with self._lock:
            syncs = list(self._syncs.values())
        for sync in syncs:
            sync.abort()

    def close(self) -> None:
        self.abort()
        self._staging = None
        self._msg_cache = None
        self._delivered = set()

    # -- engine-side evidence --------------------------------------------------

    def rpc(self, base_url: str, method: str, *args: str, timeout_s: float = 60.0) -> list[Any]:
        """``/collective_rpc`` of a worker-extension method; one result per worker."""
        r = self._sync(base_url).collective_rpc(method, list(args), timeout_s=timeout_s,
                                                step="rpc")
        res = r.get("results") if isinstance(r, dict) else None
        if not isinstance(res, list) or not res:
            raise EngineUnavailable("rpc", f"{method}: no results in {r!r}",
                                    mutation_started=False)
        return res

    def engine_checksum(self, base_url: str, *, timeout_s: float = 60.0) -> dict[str, Any]:
        """Compare the workers' checksum of the last update with the trainer's.

        Returns a dict with ``passed``, ``coverage`` (fraction of entries the
        engine could hash: fallback-loaded entries cannot be), ``mismatched``
        names and the engine's own timing.
        """
        t0 = time.monotonic()
        expect, self._expect = self._expect, None
        via, note = "rpc", ""
        res: list[Any] | None = None
        if expect is not None and expect[1] == base_url:
            res, note = self._collect(expect[0], min(timeout_s, self.results_wait_s))
            via = "ipc" if res is not None else "rpc"
        if res is None:
            res = self.rpc(base_url, "rc_cuda_ipc_checksum", self.checksum_impl,
                           timeout_s=timeout_s)
        names, mine = self.last_sent_names, self.last_sent_checksum
        want_names, digest, expected = self._digests(names, mine)
        out: dict[str, Any] = {"evidence": "worker block checksum of updated slices vs "
                               "trainer block checksum of the sent buffer",
                               "workers": len(res), "via": via,
                               **({"ipc_note": note} if note else {})}
        mism: list[str] = []
        covered = len(names)
        engine_s = wait_s = 0.0
        prefetched = True
        uncovered = 0
        for w in res:
            if not isinstance(w, dict):
                raise EngineUnavailable("rpc", f"bad checksum reply {w!r}",
                                        mutation_started=False)
            theirs = w.get("values")
            same_names = (w.get("names_digest") == want_names if "names_digest" in w
                          else w.get("names_digest60") == names_digest60(want_names))
            if not same_names or not isinstance(theirs, list) \
                    or len(theirs) != len(names):
                mism.append("<layout differs from the last update sent>")
                covered = 0
                continue
            engine_s = max(engine_s, float(w.get("elapsed_s", 0.0)))
            wait_s = max(wait_s, float(w.get("wait_s", 0.0)))
            prefetched = prefetched and bool(w.get("prefetched"))
            uncovered = max(uncovered, int(w.get("n_uncovered", 0)))
            # The one comparison (verification.checksums): a value the worker could
            # not hash (None) is not compared, so it lowers this worker's coverage.
            r = compare(dict(zip(names, theirs, strict=True)), expected, keyed_by="position")
            mism.extend(r.mismatched)
            covered = min(covered, r.compared)
        self._last_check_url = base_url
        out.update(passed=bool(names) and not mism and covered == len(names) and not uncovered,
                   n_uncovered=uncovered,
                   coverage=(covered / len(names)) if names else 0.0,
                   mismatched=mism[:20], n_mismatched=len(mism),
                   engine_s=engine_s, engine_wait_s=wait_s, prefetched=prefetched,
                   rpc_s=time.monotonic() - t0,
                   trainer_s=self.last_timings.trainer_checksum_s,
                   digest=digest if names else None)
        self.last_check = out
        return out

    # -- colocated training (engine.sleep.SleepAwareTransport) --------------

    def after_wake(self, base_url: str, *, timeout_s: float = 60.0) -> dict[str, Any]:
        """After the weights woke: the workers drop what the sleep made stale (their
        prefetched checksum always; plans and programs if a parameter moved)."""
        self._expect = None  # a result slot filled before the sleep describes nothing now
        return {"workers": self.rpc(base_url, "rc_cuda_ipc_after_wake", timeout_s=timeout_s)}

    def recovery_checksums(self, base_url: str) -> dict[str, str]:
        """``param_checksums`` as text: a recoverer's ``read_checksums`` on vLLM 0.26.

        That vLLM has no ``/weight_checker``; the workers hash every parameter
        themselves, and a reference taken the same way from a cold engine on
        the checkpoint is what a replacement process must match.
        """
        return {k: str(v) for k, v in self.param_checksums(base_url).items()}

    def param_checksums(self, base_url: str, *, timeout_s: float = 60.0) -> dict[str, int]:
        """Every engine parameter's block checksum, hashed now by the workers.

        Keyed by the engine's own names (``tp<rank>:<name>`` with several workers).
        """
        res = self.rpc(base_url, "rc_cuda_ipc_param_checksums", timeout_s=timeout_s)
        out: dict[str, int] = {}
        for i, w in enumerate(res):
            if not isinstance(w, dict) or not isinstance(w.get("names"), list) or \
                    not isinstance(w.get("values"), list) or \
                    len(w["names"]) != len(w["values"]):
                raise EngineUnavailable("rpc", f"bad parameter checksum reply {w!r:.200}",
                                        mutation_started=False)
            pre = "" if len(res) == 1 else f"tp{w.get('rank', i)}:"
            out.update((pre + str(n), int(v)) for n, v in zip(w["names"], w["values"],
                                                              strict=True))
        return out

    def engine_memory(self, base_url: str, *, timeout_s: float = 30.0) -> dict[str, Any]:
        """The device memory as the workers see it (summed over workers), with its source."""
        res = self.rpc(base_url, "rc_cuda_ipc_memory", timeout_s=timeout_s)
        out: dict[str, Any] = {}
        for w in res:
            if not isinstance(w, dict):
                raise EngineUnavailable("rpc", f"bad memory reply {w!r:.200}",
                                        mutation_started=False)
            for k, v in w.items():
                if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                    out[k] = out.get(k, 0) + v
        out["source"] = ("rc_cuda_ipc workers: cudaMemGetInfo (the whole device) and vLLM's "
                         "CuMemAllocator pools")
        return out

    def engine_parameter_check(self) -> Check | None:
        """The last validation's worker checksum, over the engine's whole parameter list.

        ``coverage`` is the fraction of the engine's parameters that the update
        wrote whole and whose written slices were compared; it passes only
        when every parameter was (after a level-2 sleep nothing else holds
        the policy's values). ``None`` before a validation, or when the
        workers did not say how many parameters they have.
        """
        r, url = self.last_check, self._last_check_url
        n = self._n_params.get(url) if url is not None else None
        if not r or not n:
            return None
        unc = min(n, int(r.get("n_uncovered", 0)))
        sent = float(r.get("coverage", 0.0))
        cov = (n - unc) / n * (1.0 if sent >= 1.0 else sent)
        return Check("engine_parameters", bool(r.get("passed")) and unc == 0,
                     detail=f"{n - unc}/{n} engine parameters written whole by the update; "
                     f"{int(r.get('n_mismatched', 0))} sent tensors mismatched",
                     coverage=cov, level=VerificationLevel.ENGINE_CHECKSUM)

    def _result_slot(self, base_url: str, n_entries: int) -> ResultSlot | None:
        """This update's result slot (a fresh nonce), or None where ``ipc`` cannot be used."""
        ranks = self._ranks.get(base_url)
        if not (self.compute_checksum and self.checksum_results == "ipc" and ranks
                and self.device.type == "cuda"):
            return None
        rows, row_len = len(ranks), ROW_HEADER + n_entries
        s = self._slot
        if s is None or s[0].shape != (rows, row_len):
            buf = torch.zeros(8 * rows * row_len, dtype=torch.uint8, device=self.device)
            torch.cuda.synchronize(self.device)  # zeroed before anyone maps it
            s = self._slot = (buf.view(torch.int64).view(rows, row_len), share_buffer(buf))
        return ResultSlot(s[1], secrets.randbelow((1 << 62) - 1) + 1, rows, row_len)

    def _collect(self, slot: ResultSlot, wait_s: float) -> tuple[list[Any] | None, str]:
        """The workers' rows of ``slot``, once each carries its nonce; (None, why) if not."""
        assert self._slot is not None
        rows = self._slot[0]
        if self._read_stream is None and rows.is_cuda:
            # Reads on a stream of their own: trainer work queued on the default
            # stream does not delay the validation.
            self._read_stream = torch.cuda.Stream(rows.device)  # type: ignore[no-untyped-call]
        t = time.monotonic()
        deadline = t + wait_s
        with (torch.cuda.stream(self._read_stream) if rows.is_cuda
              else contextlib.nullcontext()):
            # A row's nonce is written after its values (stream order on the worker):
            # once every row shows ours, a second read gets the values it covers.
            while not bool((rows[:, ROW_NONCE].cpu() == slot.nonce).all()):
                if time.monotonic() >= deadline:
                    return None, f"no result for this update within {wait_s:.3g}s: asked"
                time.sleep(5e-5)
            data = rows.cpu().tolist()
        waited = time.monotonic() - t
        out: list[Any] = []
        for r in data:
            count = r[ROW_COUNT]
            if r[ROW_NONCE] != slot.nonce or not 0 <= count <= slot.row_len - ROW_HEADER:
                return None, "a worker published no values at finish: asked"
            out.append({"values": [v if v >= 0 else None
                                   for v in r[ROW_HEADER:ROW_HEADER + count]],
                        "names_digest60": r[ROW_NAMES], "n_uncovered": r[ROW_UNCOVERED],
                        "elapsed_s": waited, "wait_s": waited, "prefetched": True})
        return out, ""

    def _digests(self, names: tuple[str, ...], values: list[int]
                 ) -> tuple[str, str, dict[str, int]]:
        """(names digest, checksum digest, name -> value) of what was sent, once per send.

        Keyed by the very objects sent (identity: a new list of values or names is
        a new key); the names digest once per layout (``PackedWeights.names()`` is
        one tuple), the rest once per set of values (``precompute_checksum`` makes
        them at staging, outside the paused window).
        """
        nc = self._names_cache
        if nc is None or nc[0] is not names:
            nc = self._names_cache = (names, names_digest(names))
        c = self._digest_cache
        if c is None or c[0] is not names or c[1] is not values:
            c = self._digest_cache = (names, values, checksum_digest(names, values),
                                      dict(zip(names, values, strict=True)))
        return nc[1], c[2], c[3]

    def validation_check(self, base_url: str, *, timeout_s: float = 60.0) -> Check:
        """The paused validation's evidence on an engine without a version label.

        A ``Check`` at ``ENGINE_CHECKSUM`` level: the workers' block checksum
        of the slices the last update wrote equals the trainer's checksum of
        the buffer it sent, for every tensor (coverage 1.0) and with every
        model parameter covered by the update. Before this transport wrote to
        ``base_url`` (a takeover's observation of what the engine already holds)
        it is a passing check of no level: it establishes nothing.
        """
        if base_url not in self._sent_to:
            return Check("worker_block_checksum", True, level=None, coverage=0.0,
                         detail="nothing sent to this engine by this transport since it "
                                "connected: no write to check")
        r = self.engine_checksum(base_url, timeout_s=timeout_s)
        detail = (f"{r['evidence']} (via {r['via']}); workers={r['workers']} "
                  f"coverage={r['coverage']:.3f} "
                  f"mismatched={r['n_mismatched']} uncovered_params={r['n_uncovered']} "
                  f"engine_s={r['engine_s']:.4f} trainer_s={r['trainer_s']:.4f}")
        if r["mismatched"]:
            detail += f" first mismatches: {r['mismatched'][:3]}"
        return Check("worker_block_checksum", bool(r["passed"]), detail=detail,
                     coverage=float(r["coverage"]), level=VerificationLevel.ENGINE_CHECKSUM)

    # -- internals -------------------------------------------------------------

    def _packed(self, source: Any, tm: SendTimings) -> PackedWeights:
        self.last_zero_copy = True
        if isinstance(source, PackedWeights):
            return source
        t = time.monotonic()
        checked = getattr(source, "checked_tensors", None)
        fixed = checked() if callable(checked) else None  # a state-dict WeightSource
        if fixed is not None:
            # The hot path: the trainer's buffer staged as its own views. Whether the
            # source is exactly an adopted buffer's entries is read from every tensor
            # in a few C-level passes (holds_tensors), not one Python step per tensor;
            # anything else takes the general path below, which copies.
            for pk in self._adopted:
                if pk.holds_tensors(fixed[0], fixed[1]):
                    tm.pack_s = time.monotonic() - t
                    return pk
        if callable(getattr(source, "named_tensors", None)):  # a rolloutcore WeightSource
            items = list(source.named_tensors())
        elif isinstance(source, Mapping):
            items = list(source.items())
        else:
            items = list(source)
        if not items:
            raise BadInput("nothing to send")
        for n, x in items:
            if not isinstance(n, str) or not isinstance(x, torch.Tensor):
                raise BadInput("source must yield (name, tensor) pairs")
        for pk in self._adopted:
            if pk.holds(items):
                tm.pack_s = time.monotonic() - t
                return pk
        self.last_zero_copy = False
        st = self._staging
        if st is None or st.names() != tuple(n for n, _ in items) or any(
                tuple(x.shape) != tuple(st.tensor(n).shape) or x.dtype != st.tensor(n).dtype
                for n, x in items):
            st = self._staging = PackedWeights.like(items, device=self.device)
        st.load_(items)
        tm.pack_s = time.monotonic() - t
        return st

    def _message(self, packed: PackedWeights) -> UpdateMessage:
        c = self._msg_cache
        if c is not None and c[0] is packed and c[1] == self.mode:
            return c[2]
        msg = packed.message(self.mode)
        self._msg_cache = (packed, self.mode, msg)
        return msg

    @staticmethod
    def _check_url(base_url: str) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise BadInput(f"base_url must be an http(s) URL, got {base_url!r}")

    def _sync(self, base_url: str) -> HttpWeightSync:
        """The engine's weight-sync client (one pool per engine, closed by ``abort``)."""
        with self._lock:
            sync = self._syncs.get(base_url)
            if sync is None:
                sync = self._syncs[base_url] = HttpWeightSync(base_url, pooled=True)
            return sync
