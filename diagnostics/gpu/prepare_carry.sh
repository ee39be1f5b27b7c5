#!/usr/bin/env bash
# Prepare, on this (network-connected) machine, everything vLLM 0.26.0 needs on
# the H200 beyond the device image, as pieces small enough for one `run` call.
#
# Why pieces: one device call carries at most 64 MiB of working tree, and the
# vLLM 0.26.0 wheel alone is ~290 MB. Each piece travels in its own call and is
# copied into /tmp there, which survives while the machine is kept warm.
#
# Output (git-ignored): .whl/ (downloaded wheels), .carry/piece-NN (<= 52 MB each)
# plus .carry/MANIFEST (sha256 of the joined archive and of every piece).
# Ray is NOT carried: rolloutcore's `rc_cuda_ipc` backend never imports vLLM's
# `ipc` engine module (which imports ray at module level).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PIP=${PIP:-python3 -m pip}
PIECE_BYTES=${PIECE_BYTES:-52000000}
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64)
COMMON=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
        --abi cp312 --abi abi3 --abi none "${PLAT[@]}" -d .whl)

# Beyond the image (torch 2.11.0+cu130, transformers 5.17, numpy, ... are there).
# List from ../shared/VLLM-FACTS.md (H200 section), minus ray and its deps.
EXTRA=(
  vllm==0.26.0
  fastapi==0.136.3 starlette==1.10.0 pydantic==2.13.5 pydantic-core==2.46.5
  typing-inspection==0.4.2 annotated-types==0.8.0 pyzmq==27.3.0 cbor2==6.3.0
  openai-harmony==0.0.8 openai==2.54.0 sniffio==1.3.1 distro==1.9.0
  msgspec==0.22.0 pybase64==1.5.1 cachetools==8.0.2 llguidance==1.7.6
  xgrammar==0.2.7 apache-tvm-ffi==0.1.10 uvicorn==0.54.0 watchfiles==1.3.0
  partial-json-parser==0.2.1.1.post7 model-hosting-container-standards==0.1.16
  jmespath==1.1.0 prometheus-fastapi-instrumentator==8.1.0
  httptools==0.9.0  # the gateway's HTTP parser (service_path of h200_8b_ipc.py)
)
mkdir -p .whl
for spec in "${EXTRA[@]}"; do
  name=${spec%%==*}
  norm=$(echo "$name" | tr '-' '_' | tr 'A-Z' 'a-z')
  if ls .whl 2>/dev/null | tr 'A-Z' 'a-z' | grep -q "^${norm}-${spec##*==}-"; then
    continue
  fi
  $PIP download -q "${COMMON[@]}" "$spec"
done

# The rolloutcore package itself travels with the working tree (src/), but its
# entry points (vllm.general_plugins) must be installed where vLLM looks:
# install_on_device.sh builds a tiny dist-info for it there; nothing to do here.

rm -rf .carry && mkdir -p .carry
tar -C .whl -cf .carry/wheels.tar .
( cd .carry && split -b "$PIECE_BYTES" -d -a 2 wheels.tar piece- )
( cd .carry && sha256sum wheels.tar piece-* > MANIFEST && rm wheels.tar )
ls -l .carry
echo "pieces: $(ls .carry/piece-* | wc -l)"
