"""vLLM's CPU build has no sleep mode; RolloutCore refuses to sleep it (issue 21).

On a real CPU vLLM 0.32:

* ``--enable-sleep-mode`` stops the server at start ("Sleep mode is not
  supported on current platform");
* without it, ``/sleep`` is still routed (dev mode) and answers 200, the
  engine then reports ``is_sleeping`` true, but its worker ignores the call
  ("sleep mode is not supported on CPU, ignore it") and keeps every byte;
* so the adapter, which reads ``enable_sleep_mode`` from ``/server_info``,
  refuses ``LifecycleRunner.sleep`` before any call: the update fails as
  ``no_mutation``, the controller is READY again, the engine serves on.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from enginetools import EngineFactory, TinyModels
from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.runner import LifecycleRunner
from rolloutcore.core.lifecycle import State
from rolloutcore.core.versions import ParameterManifest, Provenance, WeightIdentity
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.port import VllmAdapter
from rolloutcore.engine.process import ManagedEngine, vllm_available
from rolloutcore.errors import EffectError, UpdateFailed

pytestmark = [
    pytest.mark.engine,
    # The slow lane since #30 (2 min to learn the CPU build has no sleep mode);
    # tests/test_vllm_sleep_unit.py is the CI lane's.
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]


def test_the_cpu_build_has_no_sleep_mode_and_the_adapter_refuses_it(
        engine_factory: EngineFactory, tiny_models: TinyModels, tmp_path: Path) -> None:
    flagged = ManagedEngine(tiny_models.A, backend=None, extra_args=["--enable-sleep-mode"],
                            log_dir=tmp_path, startup_timeout_s=300)
    with pytest.raises(EffectError) as ex:
        flagged.start()
    flagged.stop()
    assert "Sleep mode is not supported on current platform" in str(ex.value) + \
        flagged.log_tail(400)

    eng = engine_factory(tiny_models.A, backend=None)
    http = VllmHTTP(eng.base_url, timeout_s=60)
    try:
        adapter = VllmAdapter(http, engine_epoch=eng.epoch)
        c = LifecycleController()
        runner = LifecycleRunner(c, adapter)
        ident = WeightIdentity.declare(ParameterManifest.from_items([("w", (1,), "bfloat16")]),
                                       Provenance(str(tiny_models.A)))
        boot = runner.bootstrap(ident)
        assert boot.accepted
        with pytest.raises(UpdateFailed) as fail:
            runner.sleep(2)
        assert fail.value.classification == "no_mutation" and fail.value.state == "READY"
        assert "enable-sleep-mode" in fail.value.reason
        assert c.state is State.READY and c.current_sleep is None
        assert http.is_sleeping() is False and http.is_paused() is False
        assert len(http.generate([1, 2, 3], max_tokens=2).token_ids) == 2

        # Why it must refuse: the CPU engine accepts /sleep, says it sleeps, keeps everything.
        with httpx.Client(base_url=eng.base_url, timeout=60) as raw:
            assert raw.post("/sleep", params={"level": "1", "mode": "wait"}).status_code == 200
            assert raw.get("/is_sleeping").json() == {"is_sleeping": True}
            assert raw.post("/wake_up").status_code == 200
        assert "sleep mode is not supported on CPU" in eng.log_tail(2000)
        assert http.is_sleeping() is False
        assert len(http.generate([1, 2, 3], max_tokens=2).token_ids) == 2
    finally:
        http.close()  # a failed assertion must not leak its connection into the next test
