"""The plugin's one host setting: ``ROLLOUTCORE_VLLM_IDLE_SPIN_S`` on vLLM's SpinCondition."""

from __future__ import annotations

import inspect
import logging
import subprocess
import sys

import pytest

from rolloutcore.errors import BadInput
from rolloutcore.transports.vllm_plugin import IDLE_SPIN_ENV, apply_idle_spin, parse_idle_spin


def _spin_class() -> type:
    class SpinCondition:   # the shape of vLLM 0.26-0.32's
        def __init__(self, is_reader: bool, context: object, notify_address: str,
                     busy_loop_s: float = 1) -> None:
            self.busy_loop_s = busy_loop_s
    return SpinCondition


def test_unset_or_empty_changes_nothing() -> None:
    cls = _spin_class()
    assert apply_idle_spin({}, cls) is None
    assert apply_idle_spin({IDLE_SPIN_ENV: " "}, cls) is None
    assert cls(True, None, "x").busy_loop_s == 1


def test_the_value_becomes_the_default_and_again_is_a_no_op() -> None:
    cls = _spin_class()
    assert apply_idle_spin({IDLE_SPIN_ENV: "0.1"}, cls) == 0.1
    assert cls(True, None, "x").busy_loop_s == 0.1
    assert apply_idle_spin({IDLE_SPIN_ENV: "0.1"}, cls) == 0.1
    assert cls(True, None, "x", 3).busy_loop_s == 3   # an explicit argument still wins
    assert list(inspect.signature(cls.__init__).parameters) == [
        "self", "is_reader", "context", "notify_address", "busy_loop_s"]


# 0 is refused: with no spin vLLM's reader misses a burst's second wake-up (10 s requests)
@pytest.mark.parametrize("raw", ["0", "0.001", "-1", "61", "nan", "inf", "soon", "1e9"])
def test_bad_values_are_refused_and_logged_and_vllm_keeps_its_own(
        raw: str, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(BadInput, match=IDLE_SPIN_ENV):
        parse_idle_spin(raw)
    cls = _spin_class()
    with caplog.at_level(logging.WARNING):
        assert apply_idle_spin({IDLE_SPIN_ENV: raw}, cls) is None
    assert IDLE_SPIN_ENV in caplog.text
    assert cls(True, None, "x").busy_loop_s == 1


def test_a_vllm_without_that_default_is_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    class Other:
        def __init__(self, is_reader: bool, poll_s: float = 2.0) -> None:
            self.poll_s = poll_s

    with caplog.at_level(logging.WARNING):
        assert apply_idle_spin({IDLE_SPIN_ENV: "0.1"}, Other) is None
    assert "no busy_loop_s default" in caplog.text
    assert Other(True).poll_s == 2.0


@pytest.mark.engine
def test_the_installed_vllm_takes_it_through_the_plugin_entry_point() -> None:
    """In a fresh process, as vLLM's own processes load it: ``register()`` then the class."""
    pytest.importorskip("vllm")
    code = ("import inspect, os\n"
            f"os.environ[{IDLE_SPIN_ENV!r}] = '0.25'\n"
            "from rolloutcore.transports.vllm_plugin import register\n"
            "register(); register()\n"
            "from vllm.distributed.device_communicators.shm_broadcast import SpinCondition\n"
            "print(inspect.signature(SpinCondition.__init__).parameters['busy_loop_s'].default)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "0.25"
