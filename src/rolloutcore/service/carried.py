"""The data plane's requests under an asynchronous update mode (keep, recompute; #29).

A gateway over a ``keep`` or ``recompute`` controller lets updates begin
while requests are bound: the runner pauses the engine as the mode's row
says (``core.rules.UPDATE_MODES``) and the controller *carries* the bound
requests (its ``carry`` record). This module is the data plane's side of
that, the same machinery the in-process ``control.async_modes.RolloutClient``
uses, reached over HTTP:

* every request is salted by the version it is submitted under
  (``core.cache_salt``), so no request reuses KV of another version;
* the answer carries the admission version in ``X-RolloutCore-Version``
  (as in strict mode) and, in the ``rolloutcore`` body field,
  ``token_versions``: per output token which version sampled it and which
  versions computed the KV it attended to (``provenance.token_versions``),
  stitched from the engine requests by ``provenance.stitch`` exactly as in
  process; a stream gets them in a last event before ``[DONE]``;
* ``keep``: the stream is frozen in the engine during the update and
  continues after it; tokens read after the update's resume instant are
  the new version's (``VersionClock``), checked against vLLM 0.32's own
  ``weight_versions`` spans where the route has them
  (``/inference/v1/generate``);
* ``recompute``: the pause aborts the engine request; the gateway keeps
  the tokens (and logprobs) relayed so far, waits for the update to end,
  and resubmits prompt + output so far under the new version, salted by
  it, continuing the same answer to the client: one stream, one JSON
  answer, whose ``weight_versions`` cover the whole output. vLLM has no
  token-exact way to continue a chat or text completion, so only the
  token route resubmits; a chat or completion the pause aborted ends
  ``finish_reason: abort``, marked unattributable with the reason;
* ``max_staleness``: a request whose oldest tokens would be more than
  ``k`` published versions old when the update publishes is ended at the
  pause (the controller lists it in the ``carry`` record): its stream ends
  with an ``OverStalenessBound`` error event, a JSON answer is a 503;
  neither is ever labelled attributable.

Per-token versions need token ids per event: chat and completion requests
are forwarded with ``return_token_ids`` (vLLM adds ``token_ids`` to each
choice; nothing else changes). A non-streamed chat or completion answer has
no read instants to derive versions from and no engine spans: if an update
was published while it ran, its tokens cannot be attributed and it is
marked so (stream it, or use the token route). Every request carries one
sample (``n`` = 1, one prompt): more is refused with a 400 before anything
is admitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rolloutcore.control.async_modes import VersionClock, attribute, segment_run
from rolloutcore.control.controller import LifecycleController
from rolloutcore.core.cache_salt import salt_for
from rolloutcore.core.lifecycle import Binding, State, UpdateMode
from rolloutcore.core.records import Carry, Record
from rolloutcore.core.versions import WeightVersion
from rolloutcore.engine.routes import Routes
from rolloutcore.engine.stream import chunk_of
from rolloutcore.engine.wire import GenerationChunk
from rolloutcore.errors import BadInput, EffectError, EngineUnreachable
from rolloutcore.service.wire import (
    BODY_FIELD,
    Send,
    dumps,
    error_body,
    inject_json,
    send_error,
    upstream_failure,
)

if TYPE_CHECKING:
    from rolloutcore.service.admission import Target
    from rolloutcore.service.liveness import Flight

#: ``service.proxy``'s ``DataPlane`` and ``FinishedRequest`` (which import this module).
DataPlane = Any
FinishedRequest = Any

__all__ = ["CarriedRelay", "TOKEN_VERSIONS_FIELD", "check_one_sample"]

GENERATE = Routes.GENERATE
#: The body-field key of an answer's per-token versions.
TOKEN_VERSIONS_FIELD = "token_versions"
_DONE = b"data: [DONE]\n\n"
_NO_DONE = "vLLM stream ended without its [DONE] terminator"
_UPDATING = frozenset({State.DRAINING, State.QUIESCED, State.UPDATING, State.INVALIDATING,
                       State.VALIDATING, State.RESUMING})
#: How long a finished request waits for an update that is resuming to publish or fail
#: (its last tokens' version is that update's outcome).
_RESUMING_WAIT_S = 60.0


def check_one_sample(route: str, payload: Mapping[str, Any]) -> str:
    """Why an asynchronous-mode request cannot be carried ("" when it can)."""
    if route == GENERATE:
        sp = payload.get("sampling_params")
        n = sp.get("n", 1) if isinstance(sp, dict) else 1
    else:
        n = payload.get("n", 1)
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and \
                len(prompt) != 1:
            return ("asynchronous update modes carry one sample per request: send one "
                        "prompt, not a list of prompts")
    if n not in (1, None):
        return ("asynchronous update modes carry one sample per request: 'n' must be 1 "
                "(send n requests)")
    return ""


def _max_tokens(route: str, payload: Mapping[str, Any]) -> int | None:
    if route == GENERATE:
        sp = payload.get("sampling_params")
        v = sp.get("max_tokens") if isinstance(sp, dict) else None
    else:
        v = payload.get("max_completion_tokens", payload.get("max_tokens"))
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _prompt_ids(payload: Mapping[str, Any]) -> list[int] | None:
    ids = payload.get("token_ids")
    if isinstance(ids, list) and ids and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        return list(ids)
    return None


def _text_chunk(ev: Mapping[str, Any], read_at: float) -> GenerationChunk:
    """A chat or completion event (or answer) as a chunk: its token ids, its finish."""
    choices = ev.get("choices") or []
    if not choices:
        return GenerationChunk((), None, None, None, read_at)
    ch = choices[0]
    toks = tuple(int(x) for x in ch.get("token_ids") or ())
    return GenerationChunk(toks, None, ch.get("finish_reason"), None, read_at)


@dataclass
class _Segment:
    """One engine request of a carried rollout, as read."""

    version: WeightVersion
    salt: str | None
    prefill: int
    chunks: list[GenerationChunk] = field(default_factory=list)
    #: Whether its tokens came with read instants (a stream) or all at once.
    streamed: bool = True

    @property
    def tokens(self) -> list[int]:
        return [t for ch in self.chunks for t in ch.token_ids]

    @property
    def finish(self) -> str | None:
        return next((ch.finish_reason for ch in reversed(self.chunks)
                     if ch.finish_reason is not None), None)


class _ClientStream:
    """The client's side of a carried stream: events as the gateway forwards them.

    Stands in for ``SseRelay`` on the flight (``f.sse``), so that a request the
    gateway cuts (the staleness bound, a slow client, shutdown) ends with an
    error event like any other stream.
    """

    def __init__(self, send: Send, info: dict[str, Any], collect: bool, limit: int) -> None:
        self._send = send
        self._info = info
        self._first = True
        self._collect = collect
        self._room = limit
        self.overflow = False
        self.events: list[dict[str, Any]] = []

    def _encode(self, obj: dict[str, Any], raw: bytes | None = None) -> bytes:
        """One event; ``raw`` is its serialized form as vLLM sent it (passed on as is)."""
        if self._first:
            self._first, raw = False, None
            obj = {**obj, BODY_FIELD: self._info}
        out = dumps(obj) if raw is None else raw
        if self._collect:
            self._room -= len(out)
            if self._room < 0:
                self._collect, self.overflow = False, True
                self.events.clear()
            else:
                self.events.append(obj)
        return b"data: " + out + b"\n\n"

    async def event(self, obj: dict[str, Any]) -> None:
        await self._send({"type": "http.response.body", "body": self._encode(obj),
                          "more_body": True})

    async def events_raw(self, evs: list[tuple[dict[str, Any], bytes]]) -> None:
        """Several events in one send, each passed on as vLLM serialized it."""
        body = b"".join(self._encode(obj, raw) for obj, raw in evs)
        await self._send({"type": "http.response.body", "body": body, "more_body": True})

    async def end(self, objs: list[dict[str, Any]]) -> None:
        body = b"".join(self._encode(o) for o in objs) + _DONE
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    # -- what the data plane's cut handling asks of a flight's relay
    def flush(self) -> bytes:
        return b""

    def error_tail(self, message: str, status: int = 502, kind: str = "UpstreamError") -> bytes:
        return self._encode(error_body(status, message, kind, **self._info)) + _DONE


class CarriedRelay:
    """The data plane's relay of requests under a keep or recompute controller."""

    def __init__(self, plane: DataPlane, controller: LifecycleController) -> None:
        if controller.update_mode is UpdateMode.STRICT:
            raise BadInput("a carried relay serves the asynchronous update modes only")
        self.plane = plane
        self.controller = controller
        self.mode = controller.update_mode
        #: When each published update resumed the engine: the tokens' versions.
        self.clock = VersionClock(controller)
        self.carried = 0
        self.resubmitted = 0
        self.over_bound = 0
        self._tasks: set[asyncio.Future[Any]] = set()
        controller.add_listener(self._on_record)

    # ------------------------------------------------------------ the staleness bound
    def _on_record(self, rec: Record) -> None:
        """At an update's pause: end the requests the bound excludes (any thread)."""
        if not isinstance(rec, Carry):
            return
        self.carried += len(rec.carried)
        if not rec.over_bound:
            return
        loop = self.plane.loop
        why = (f"ended by update {rec.update_id}: its oldest tokens would be more than "
               f"max_staleness={rec.max_staleness} published versions old")
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._cut_over_bound, rec.over_bound, why)

    def _cut_over_bound(self, rids: tuple[str, ...], why: str) -> None:
        self.over_bound += len(rids)
        task = asyncio.ensure_future(self.plane.flights.abort_ids(rids, why, kind="over_bound"))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------ one request
    def _body(self, route: str, payload: Mapping[str, Any], salt: str | None,
              produced: list[int], prompt: list[int] | None) -> bytes:
        body = dict(payload)
        if salt is not None:
            body["cache_salt"] = salt
        if route != GENERATE:
            body["return_token_ids"] = True
        elif produced:
            assert prompt is not None
            body["token_ids"] = prompt + produced
            sp = dict(body.get("sampling_params") or {})
            mt = _max_tokens(route, payload)
            if mt is not None:
                sp["max_tokens"] = mt - len(produced)
            body["sampling_params"] = sp
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()

    async def relay(self, send: Send, route: str, payload: dict[str, Any], binding: Binding,
                    target: Target, fin: FinishedRequest, f: Flight,
                    vh: list[tuple[bytes, bytes]], info: dict[str, Any]) -> None:
        plane, cfg, ctl = self.plane, self.plane.config, target.controller
        upstream = plane.upstreams.get(target.name)
        if upstream is None:
            raise EffectError("relay", "data plane not started")
        rid = binding.rollout_id or ""
        stream = payload.get("stream") is True
        gen = route == GENERATE
        sp = payload.get("sampling_params")
        want_lp = gen and isinstance(sp, dict) and sp.get("logprobs") is not None
        prompt = _prompt_ids(payload) if gen else None
        prefill = len(prompt) if prompt is not None else 0
        max_tokens = _max_tokens(route, payload)
        resubmit = gen and self.mode is UpdateMode.RECOMPUTE and prompt is not None
        client_salt = payload.get("cache_salt") if isinstance(payload.get("cache_salt"),
                                                              str) else None
        ver, salt = binding.version, fin.cache_salt
        path = plane.route_path(route)
        segs: list[_Segment] = []
        out: _ClientStream | None = None
        held: list[dict[str, Any]] = []   # the last segment's final event (+ usage)
        merged: dict[str, Any] | None = None
        produced: list[int] = []
        ended: str | None = None         # why it ended early (the client is told)
        while True:
            seg = _Segment(ver, salt, prefill + len(produced), streamed=stream)
            segs.append(seg)
            updates_before = self.clock.updates
            raw = self._body(route, payload, salt, produced, prompt)
            req_id = rid if len(segs) == 1 else f"{rid}.{len(segs) - 1}"
            try:
                resp = await upstream.post(path, raw, req_id.encode())
            except EffectError as exc:  # EffectTimeout, EngineUnavailable, EngineUnreachable
                fin.status, msg, kind = upstream_failure(exc)
                plane.admission.observe(target, False, isinstance(exc, EngineUnreachable))
                plane.finishing(f, fin)
                if out is not None:
                    fin.events, fin.record_overflow = out.events, out.overflow
                    await send({"type": "http.response.body", "more_body": False,
                                "body": out.error_tail(msg)})
                else:
                    await send_error(send, fin.status, msg, kind, vh, **info)
                return
            complete = False
            try:
                if resp.status != 200 or (resp.content_type == "text/event-stream") != stream:
                    if out is None:  # vLLM's own refusal: relayed as it is
                        await self._relay_refusal(send, resp, fin, f, vh, info, target)
                        complete = fin.ending == "complete"
                        return
                    ended = f"the engine refused the resubmission (HTTP {resp.status})"
                    fin.status = 502
                    break
                if stream:
                    if out is None:
                        out = f.sse = _ClientStream(send, info, plane.collecting,
                                                    cfg.max_record_bytes)
                        hdrs = [(k, v) for k, v in resp.raw_headers
                                if k.lower() not in _HOP] + vh
                        f.started_response = True
                        fin.status = 200
                        await send({"type": "http.response.start", "status": 200,
                                    "headers": hdrs})
                    err = await self._read_stream(resp, out, seg, gen, want_lp, held)
                    if err is _NO_DONE and resubmit and (
                            self.clock.updates != updates_before or ctl.state in _UPDATING):
                        err = None  # vLLM 0.26 ends a stream the pause aborted, no event
                    if err is not None:
                        ended, fin.status = err, 502
                        break
                else:
                    body = await resp.read(cfg.max_response_bytes)
                    read_at = time.monotonic()
                    try:
                        obj = json.loads(body)
                        seg.chunks.append(chunk_of(obj, want_lp, read_at) if gen
                                          else _text_chunk(obj, read_at))
                    except (ValueError, KeyError, TypeError, AttributeError, BadInput) as exc:
                        ended, fin.status = f"unreadable vLLM answer: {exc}", 502
                        break
                    merged = obj if merged is None else _merge_json(merged, obj)
                complete = True
            except EffectError as exc:
                ended, fin.status = f"vLLM answer broke off: {exc!r}", 502
                break
            finally:
                if complete:
                    resp.release()
                else:
                    resp.close()
            produced += seg.tokens
            finish = seg.finish
            if finish not in (None, "abort"):
                break
            paused = self.clock.updates != updates_before or ctl.state in _UPDATING
            if not (resubmit and paused) or (max_tokens is not None
                                             and len(produced) >= max_tokens):
                break
            # Aborted at an update's pause: wait for the update to end, resubmit.
            if not await self._until(lambda: ctl.state in (State.READY, State.TAINTED),
                                     cfg.upstream_read_s):
                ended = f"the update did not end within {cfg.upstream_read_s:g}s"
                break
            nxt = ctl.serving_version(rid)
            if ctl.state is State.TAINTED or nxt is None:
                ended = ("ended by an update: its oldest tokens would have been more than "
                         f"max_staleness={ctl.max_staleness} published versions old"
                         if ctl.over_bound(rid) else
                         f"the update that aborted it left the engine {ctl.state.value}")
                break
            if held and stream and out is not None:
                # The segment's abort event is not the rollout's end: its tokens go on.
                await out.event(_continuing(held[0]))
            held.clear()
            ver = nxt
            salt = salt_for(ver, client_salt) if cfg.salt_prefix_cache else None
            self.resubmitted += 1
        await self._finish(send, route, segs, fin, f, vh, info, target, out, held, merged,
                           ended, stream)

    async def _until(self, pred: Any, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not pred():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def _relay_refusal(self, send: Send, resp: Any, fin: FinishedRequest, f: Flight,
                             vh: list[tuple[bytes, bytes]], info: dict[str, Any],
                             target: Target) -> None:
        """A first answer that is not the expected 200 (vLLM's 4xx): passed on, labelled."""
        try:
            body = await resp.read(self.plane.config.max_response_bytes)
        except EffectError as exc:
            fin.status = 502
            self.plane.finishing(f, fin)
            await send_error(send, 502, f"vLLM answer broke off: {exc!r}", "UpstreamError", vh,
                             **info)
            return
        fin.status, fin.ending = resp.status, "complete"
        self.plane.admission.observe(target, True, False)
        self.plane.finishing(f, fin)
        body, fin.response = inject_json(body, info)
        hdrs = [(k, v) for k, v in resp.raw_headers if k.lower() not in _HOP] + vh + [
            (b"content-length", str(len(body)).encode())]
        f.started_response = True
        await send({"type": "http.response.start", "status": resp.status, "headers": hdrs})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _read_stream(self, resp: Any, out: _ClientStream, seg: _Segment, gen: bool,
                           want_lp: bool, held: list[dict[str, Any]]) -> str | None:
        """Forward one engine stream's events, holding back its final one (and usage)."""
        buf = b""
        done = False
        async for chunk in resp.iter_any():
            buf += chunk
            ready: list[tuple[dict[str, Any], bytes]] = []
            while (i := buf.find(b"\n\n")) >= 0:
                raw, buf = buf[:i], buf[i + 2:]
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    done = True
                    continue
                read_at = time.monotonic()
                try:
                    ev = json.loads(data)
                    if not isinstance(ev, dict):
                        raise BadInput("an event that is not an object")
                    if "error" in ev and not ev.get("choices"):
                        msg = ev["error"].get("message") if isinstance(
                            ev["error"], dict) else ev["error"]
                        if ready:
                            await out.events_raw(ready)
                        return f"vLLM reported an error mid-stream: {msg}"
                    ch = chunk_of(ev, want_lp, read_at) if gen else _text_chunk(ev, read_at)
                except (ValueError, KeyError, TypeError, AttributeError, BadInput) as exc:
                    if ready:
                        await out.events_raw(ready)
                    return f"unreadable vLLM stream event: {exc}"
                seg.chunks.append(ch)
                if held or ch.finish_reason is not None:
                    held.append(ev)
                else:
                    ready.append((ev, data))
            if ready:
                await out.events_raw(ready)
        if not done:
            return _NO_DONE
        return None

    async def _finish(self, send: Send, route: str, segs: list[_Segment],
                      fin: FinishedRequest, f: Flight, vh: list[tuple[bytes, bytes]],
                      info: dict[str, Any], target: Target, out: _ClientStream | None,
                      held: list[dict[str, Any]], merged: dict[str, Any] | None,
                      ended: str | None, stream: bool) -> None:
        """Release, attribute, and send the end of the answer with its token versions."""
        plane, ctl = self.plane, target.controller
        fin.ending = "complete" if ended is None else "upstream_error"
        plane.admission.observe(target, ended is None, False)
        if ctl.state is State.RESUMING:
            # Finished while the target serves unpublished: the attribution of its last
            # tokens is that update's outcome.
            await self._until(lambda: ctl.state is not State.RESUMING, _RESUMING_WAIT_S)
        plane.finishing(f, fin)
        extra: dict[str, Any] = {}
        why = self._attribute(segs, fin, ctl, stream, ended)
        if why is not None and fin.attributable:
            fin.attributable, fin.unattributable = False, why
        if fin.token_versions is not None:
            extra[TOKEN_VERSIONS_FIELD] = fin.token_versions.to_dict()
            extra["staleness"] = fin.staleness
            extra["derived_agrees"] = fin.derived_agrees
        if not fin.attributable:
            extra["attributable"] = False
            extra["unattributable"] = fin.unattributable
        spans = fin.engine_spans
        if out is not None:  # a stream: the held final event, then the gateway's last word
            tail: list[dict[str, Any]] = []
            if held:
                tail.append(_with_spans(held[0], spans) if len(segs) > 1 else held[0])
                tail += held[1:]
            tail.append({BODY_FIELD: {**info, **extra}})
            if ended is not None:
                tail.append(error_body(502, ended, "UpstreamError", **info))
            fin.events, fin.record_overflow = out.events, out.overflow
            with contextlib.suppress(Exception):
                await out.end(tail)
            fin.events = out.events
            return
        if merged is None or ended is not None:
            status = fin.status if fin.status >= 500 else 502
            fin.status = status
            await send_error(send, status, ended or "no answer from vLLM", "UpstreamError", vh,
                             **info, **extra)
            return
        if len(segs) > 1:
            merged = _with_spans(merged, spans)
        merged[BODY_FIELD] = {**info, **extra}
        fin.response, fin.status = merged, 200
        body = dumps(merged)
        hdrs = vh + _marks(fin) + [(b"content-type", b"application/json"),
                                   (b"content-length", str(len(body)).encode())]
        f.started_response = True
        await send({"type": "http.response.start", "status": 200, "headers": hdrs})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def _attribute(self, segs: list[_Segment], fin: FinishedRequest, ctl: LifecycleController,
                   stream: bool, ended: str | None) -> str | None:
        """Stitch the segments into ``fin.token_versions``; why not, when it cannot."""
        if ended is not None or not fin.attributable:
            return ended
        finish = segs[-1].finish
        if finish == "abort":
            return ("aborted by an update's pause" + (
                "" if ctl.update_mode is not UpdateMode.RECOMPUTE else
                " (recompute mode resubmits only /inference/v1/generate: vLLM cannot "
                "continue a chat or text completion token-exactly)"))
        committed = fin.committed
        if committed is None:
            return "the controller credited it to no version"
        runs = [segment_run(self.clock, s.version, s.salt, s.prefill, s.chunks) for s in segs]
        if not stream and any(r.engine_spans is None for r in runs) and any(
                self.clock.version_at(s.chunks[-1].read_at, s.version) != s.version
                for s in segs if s.chunks):
            return ("an update was published while this non-streamed answer ran and the "
                    "engine gave no per-token versions for it: stream it, or use "
                    "/inference/v1/generate")
        got = attribute(ctl, self.mode, runs, committed)
        if isinstance(got, str):
            return got
        st, fin.staleness = got
        fin.token_versions = st.versions
        fin.engine_spans = st.engine_spans
        # The read instants' derivation against the engine's own spans (None: no spans).
        fin.derived_agrees = None if st.versions.source != "engine" else [
            (x.generation, x.start, x.end) for x in st.derived] == [
            (x.generation, x.start, x.end) for x in st.versions.spans]
        return None


#: Upstream response headers that describe the upstream connection, not the answer.
_HOP = frozenset({b"content-length", b"transfer-encoding", b"connection", b"keep-alive",
                  b"date", b"server", b"content-encoding", b"x-request-id"})


def _marks(fin: FinishedRequest) -> list[tuple[bytes, bytes]]:
    if fin.attributable:
        return []
    why = str(fin.unattributable).encode("ascii", "replace")[:300]
    return [(b"x-rolloutcore-attributable", b"false"), (b"x-rolloutcore-unattributable", why)]


def _continuing(ev: dict[str, Any]) -> dict[str, Any]:
    """An engine segment's abort event, rewritten as an ordinary event of the rollout."""
    out = dict(ev)
    chs = []
    for ch in ev.get("choices") or ():
        c = dict(ch)
        c["finish_reason"] = None
        c.pop("weight_versions", None)
        c.pop("stop_reason", None)
        chs.append(c)
    out["choices"] = chs
    return out


def _with_spans(obj: dict[str, Any], spans: tuple[tuple[str, int, int], ...] | None
                ) -> dict[str, Any]:
    """``obj`` with choice 0's ``weight_versions`` over the whole stitched output."""
    out = dict(obj)
    chs = [dict(c) for c in obj.get("choices") or ()]
    if chs:
        chs[0]["weight_versions"] = None if spans is None else [
            {"version": lab, "start": a, "end": b} for lab, a, b in spans]
        out["choices"] = chs
    return out


def _merge_json(first: dict[str, Any], nxt: dict[str, Any]) -> dict[str, Any]:
    """Two answers of one resubmitted rollout as one: tokens and logprobs continue."""
    out = dict(nxt)
    a = dict((first.get("choices") or [{}])[0])
    b = (nxt.get("choices") or [{}])[0]
    a["token_ids"] = list(a.get("token_ids") or ()) + list(b.get("token_ids") or ())
    la, lb = a.get("logprobs"), b.get("logprobs")
    if isinstance(la, dict) and isinstance(lb, dict):
        a["logprobs"] = {**la, "content": list(la.get("content") or ()) + list(
            lb.get("content") or ())}
    for k in ("finish_reason", "stop_reason"):
        a[k] = b.get(k)
    out["choices"] = [a]
    ua, ub = first.get("usage"), nxt.get("usage")
    if isinstance(ua, dict) and isinstance(ub, dict):
        out["usage"] = {**ub, "prompt_tokens": ua.get("prompt_tokens"),
                        "completion_tokens": len(a["token_ids"])}
    return out
