"""Conformance checks: what RolloutCore relies on vLLM's routes to do.

Plain functions in trio's ``testing/_check_streams.py`` form: each takes a
factory for the thing under test (a ``VllmHTTP`` that reaches an engine:
``FakeVllm``'s transport in the fast lane, a real vLLM in the engine lane)
and asserts one part of the contract, raising ``AssertionError`` on the
first difference. Each leaves the engine as it found it (resumed, awake,
no adapter of its own loaded). ``check_all`` runs them in order.

The engine must serve ``/inference/v1/generate`` (``--enable-scale-out``) and
the dev routes (``VLLM_SERVER_DEV_MODE=1``); ``check_lora`` needs runtime
LoRA loading and a PEFT adapter directory for the served model.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

from rolloutcore.core.evidence import PauseMode
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.errors import BadInput, RequestRejected

__all__ = [
    "check_all",
    "check_cache_reset",
    "check_error_shapes",
    "check_labels_after_finish",
    "check_lora",
    "check_pause_resume",
    "check_weight_routes",
]

ClientFactory = Callable[[], VllmHTTP]

#: token ids every vocabulary has (the fake's is 256 wide)
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(40)]


def _generate_into(c: VllmHTTP, out: dict[str, Any]) -> None:
    out["g"] = c.generate(PROMPT, max_tokens=4, ignore_eos=True, timeout_s=60.0)


def check_pause_resume(make: ClientFactory, *, held_s: float = 0.5) -> None:
    """Each mode: ``/pause`` answers paused and ``/is_paused`` says so; a request sent
    while paused is held (still unanswered after ``held_s``), not lost, and finishes
    after ``/resume``."""
    if isinstance(held_s, bool) or not isinstance(held_s, (int, float)) \
            or not 0 < held_s < math.inf:
        raise BadInput(f"held_s must be a positive number of seconds, got {held_s!r}")
    with closing(make()) as c:
        for mode in PauseMode:
            assert c.pause(mode, timeout_s=60.0) is True, f"pause({mode}) did not answer paused"
            assert c.is_paused() is True, f"/is_paused false after pause({mode})"
            out: dict[str, Any] = {}
            held = threading.Thread(target=_generate_into, args=(c, out), daemon=True)
            try:
                if mode is PauseMode.KEEP:
                    held.start()
                    held.join(held_s)
                    assert held.is_alive(), "a request sent while paused (keep) was not held"
            finally:
                assert c.resume(timeout_s=60.0) is True, "/resume not 'resumed'"
            assert c.is_paused() is False, f"/is_paused true after resume from {mode}"
            if mode is PauseMode.KEEP:
                held.join(60.0)
                assert not held.is_alive(), "the held request did not finish after resume"
                assert len(out["g"].token_ids) == 4, "the held request lost tokens"
        try:
            c.pause("sideways")  # type: ignore[arg-type]
        except BadInput:
            pass
        else:
            raise AssertionError("a bad pause mode was accepted")
        assert c.is_paused() is False, "a refused pause changed the pause state"


def check_labels_after_finish(make: ClientFactory, label: str = "conformance-v1") -> None:
    """After ``/update_weight_version``, ``/weight_info`` names the label and every
    token generated after it carries it in ``weight_versions``."""
    with closing(make()) as c:
        before = c.label()
        try:
            c.set_weight_version(label)
            assert c.label() == label, "/weight_info does not name the new label"
            g = c.generate(PROMPT, max_tokens=5, ignore_eos=True)
            assert g.weight_versions is not None, "generate answered no weight_versions"
            assert [(s.version, s.start, s.end) for s in g.weight_versions] == [
                (label, 0, len(g.token_ids))], f"spans {g.weight_versions} do not cover " \
                                               f"{len(g.token_ids)} tokens with {label!r}"
        finally:
            c.set_weight_version(before or "default")


def check_cache_reset(make: ClientFactory) -> None:
    """An idle engine's ``/reset_prefix_cache`` answers ``{"success": true}``, and the
    same prompt generates the same tokens before and after (the weights did not move)."""
    with closing(make()) as c:
        a = c.generate(PROMPT, max_tokens=6, ignore_eos=True)
        ev = c.reset_prefix_cache()
        assert ev.engine_success is True, f"reset of an idle engine: {ev}"
        b = c.generate(PROMPT, max_tokens=6, ignore_eos=True)
        assert a.token_ids == b.token_ids, "a cache reset changed greedy outputs"


def check_weight_routes(make: ClientFactory) -> None:
    """``/weight_checker`` answers one sha256 per parameter, stable between calls;
    a bad label is refused before it reaches the engine, with no state change."""
    with closing(make()) as c:
        first = c.weight_checksums()
        assert first.digests, "no checksums"
        assert all(len(d) == 64 and int(d, 16) >= 0 for d in first.digests.values())
        assert c.weight_checksums().digests == first.digests, "checksums moved at rest"
        before = c.label()
        for bad in ("", "two words"):
            try:
                c.set_weight_version(bad)
            except BadInput:
                pass
            else:
                raise AssertionError(f"label {bad!r} was accepted")
        assert c.label() == before, "a refused label changed /weight_info"


def check_lora(make: ClientFactory, adapter_dir: str | Path, name: str = "conf-lora") -> None:
    """A load under the base's name or from a directory without an adapter is refused
    (4xx, nothing listed); a load lists the adapter under the base; a second load of the
    name and an unload of an unknown name are refused (4xx); unload removes it."""
    with closing(make()) as c:
        base = c.model()
        for bad_name, bad_dir in ((base, adapter_dir), (name, Path(adapter_dir) / "absent")):
            try:
                c.load_lora_adapter(bad_name, str(bad_dir))
            except RequestRejected as exc:
                assert exc.status is not None and 400 <= exc.status < 500, exc
            else:
                raise AssertionError(f"loading {bad_name!r} from {bad_dir} was accepted")
        assert set(c.models()) == {base}, "a refused load changed the listing"
        c.load_lora_adapter(name, str(adapter_dir))
        try:
            listed = c.models()
            assert listed.get(name) == base, f"{name} not listed under {base}: {listed}"
            assert listed.get(base, "missing") is None, f"base not listed: {listed}"
            g = c.generate(PROMPT, max_tokens=3, ignore_eos=True, model=name)
            assert len(g.token_ids) == 3
            try:
                c.load_lora_adapter(name, str(adapter_dir))
            except RequestRejected as exc:
                assert exc.status == 400, exc
            else:
                raise AssertionError("a second load of a loaded name was accepted")
        finally:
            c.unload_lora_adapter(name)
        assert name not in c.models(), "unload left the adapter listed"
        try:
            c.unload_lora_adapter(name)
        except RequestRejected as exc:
            assert exc.status is not None and 400 <= exc.status < 500, exc
        else:
            raise AssertionError("unloading an unknown adapter was accepted")


def check_error_shapes(make: ClientFactory) -> None:
    """An unknown model is a ``RequestRejected`` 404; bad input never leaves the client."""
    with closing(make()) as c:
        try:
            c.generate(PROMPT, max_tokens=2, model="no-such-model")
        except RequestRejected as exc:
            assert exc.status == 404, exc
        else:
            raise AssertionError("generate with an unknown model was accepted")
        for kwargs in ({"max_tokens": 0}, {"max_tokens": 2, "temperature": -1.0}):
            try:
                c.generate(PROMPT, **kwargs)
            except BadInput:
                pass
            else:
                raise AssertionError(f"generate({kwargs}) was accepted")
        assert c.health() is True


def check_all(make: ClientFactory, *, adapter_dir: str | Path | None = None,
              held_s: float = 0.5) -> None:
    """Every check; ``check_lora`` only with ``adapter_dir``; ``held_s``:
    ``check_pause_resume``'s."""
    check_error_shapes(make)
    check_pause_resume(make, held_s=held_s)
    check_cache_reset(make)
    check_labels_after_finish(make)
    check_weight_routes(make)
    if adapter_dir is not None:
        check_lora(make, adapter_dir)
