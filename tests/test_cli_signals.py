"""SIGTERM and SIGHUP end a command as Ctrl-C does (#47, symptom 4).

Each case is a real process sent a real signal: ``cli.signals.as_ctrl_c`` (what
``rolloutcore``'s ``main`` runs every command inside) turns it into whatever
SIGINT does at that moment, so ``train``'s and ``live-update``'s Ctrl-C path
(the ``interrupted`` record, the report, the engine stopped) and ``serve``'s
(uvicorn's graceful shutdown, then the engine stopped) run for it. A launched
engine whose launcher dies anyway is ``tests/test_launch_guard.py``'s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rolloutcore.control.runner import LifecycleRunner
from rolloutcore.core.lifecycle import State

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import signal, sys, time
    from rolloutcore.cli.signals import as_ctrl_c
    if sys.argv[1] == "nohup":
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with as_ctrl_c() as changed:
        try:
            if sys.argv[1] == "deferred":
                from rolloutcore.integrations.trl.common import deferred_interrupts
                with deferred_interrupts() as presses:
                    print("ready", changed, flush=True)
                    while not presses:
                        time.sleep(0.01)
                print("deferred", presses, flush=True)
            else:
                print("ready", changed, flush=True)
                time.sleep(60)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            sys.exit(130)
    print("after", signal.getsignal(signal.SIGTERM), flush=True)
""")


def _run(mode: str, *sigs: signal.Signals) -> tuple[int, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    p = subprocess.Popen([sys.executable, "-c", CHILD, mode], stdout=subprocess.PIPE,
                         text=True, env=env)
    assert p.stdout is not None
    first = p.stdout.readline()
    assert first.startswith("ready"), first
    for s in sigs:
        p.send_signal(s)
    try:
        out, _ = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, [first.strip(), *out.splitlines()]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_interrupt_as_ctrl_c_does(sig: signal.Signals) -> None:
    rc, lines = _run("plain", sig)
    assert rc == 130 and lines[1:] == ["interrupted"], lines


def test_inside_a_deferred_section_the_signal_is_noted_like_a_press() -> None:
    rc, lines = _run("deferred", signal.SIGTERM)
    assert rc == 0 and lines[1] == f"deferred [{signal.SIGINT!r}]", lines
    assert lines[2] == f"after {signal.SIG_DFL}", lines  # restored on the way out


def test_an_ignored_sighup_stays_ignored() -> None:
    """``nohup rolloutcore serve``: a closed terminal does not stop it; SIGTERM still does."""
    rc, lines = _run("nohup", signal.SIGHUP, signal.SIGTERM)
    assert lines[0] == f"ready [{int(signal.SIGTERM)}]", lines
    assert rc == 130 and lines[1:] == ["interrupted"], lines


def test_an_engine_exit_taints_a_serving_runner_at_once() -> None:
    from helpers.gateway_rig import make_parts

    _, _, c, r, j, _ = make_parts()
    assert isinstance(r, LifecycleRunner) and c.state is State.READY
    v = r.engine_exited("the launched vLLM (pid 1) exited (status -9)")
    assert v is not None and c.state is State.TAINTED
    assert any(x.kind == "note" and x.data.get("what") == "engine_exited" for x in j.records)
    assert r.engine_exited("again") is None  # already tainted: noted only
