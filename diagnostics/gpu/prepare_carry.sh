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
# Ray is NOT carried by default: rolloutcore's `rc_cuda_ipc` backend never imports
# vLLM's `ipc` engine module (which imports ray at module level).
#
# RAY=1 (opt-in; `h200_fleet.py --ray`, the engines as Ray actors): also downloads
# ray and the dependencies of ray the device image lacks into .whl-ray/, as their own
# pieces .carry/ray-piece-NN plus .carry/ray-MANIFEST; the vLLM pieces and MANIFEST
# above are made as without it (same wheels, same calls).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PIP=${PIP:-python3 -m pip}
PIECE_BYTES=${PIECE_BYTES:-52000000}
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64)
COMMON=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
        --abi cp312 --abi abi3 --abi none "${PLAT[@]}")

# VLLM=0.34 (issue 45): vLLM 0.34.0 instead, with the torch 2.14.0 and triton 3.8.0 it
# pins and the rest of its serve-path dependencies the image lacks or has too old
# (resolved by pip from vLLM 0.34.0's Requires-Dist, minus the image's packages and the
# GPU kernel packages the serve path imports lazily: flashinfer (not on PyPI at the
# pinned 0.7.3; started with VLLM_USE_FLASHINFER_SAMPLER=0), tilelang, cutlass-dsl,
# quack, tokenspeed-mla, humming-kernels, video/audio codecs). Its pieces are
# .carry/v034-piece-NN with .carry/v034-MANIFEST, beside the 0.26 ones; install with
# PREFIX=v034- SITE=/tmp/site034 install_on_device.sh.
VLLM=${VLLM:-0.26}
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
# Seen on the H100 on 2026-12-06: torch 2.14 needs NCCL >= 2.30 (ncclCommResume; PyPI has
# no 2.30.7, 2.32.6 loads), torchvision 0.29.0 (the image's breaks under torch 2.14), the
# image's transformers 5.17 wants huggingface_hub < 2 (so 2.x is not carried), and vLLM's
# engine core imports `cutlass` and `quack` at start (kernel_warmup imports the MiniMax-M3
# CuTe DSL kernels on every CUDA engine). vLLM pins nvidia-cutlass-dsl[cu13]==4.8.0 and
# quack-kernels 0.6.5, but the registry's -libs-base wheels from 4.6 on hold only the
# compiled MLIR libraries, no `cutlass/__init__.py` nor `cute` (checked 2026-12-06 for 4.6.3,
# 4.7.1, 4.8.0, 4.8.1), and quack 0.6.x needs them. 4.5.3's -libs-base holds the front end,
# and quack 0.5.0 is the newest quack that takes 4.5 (>=4.5.2): both carried. Checked here
# on the CPU: every `cutlass`/`quack` import in the static closure of vLLM 0.34's worker,
# kernel_warmup, the Qwen3 model and the API server resolves against them (the Kimi-K3,
# Muse-Spark and fmha_sm100 kernels that need 4.8 are imported only by those models). A
# Qwen3 engine runs no CuTe DSL kernel; one that did would fail loudly, not run a stand-in.
# Their .pth needs the sitecustomize that install_on_device.sh writes (a --target site on
# PYTHONPATH runs no .pth).
EXTRA_034=(
  vllm==0.34.0 torch==2.14.0 triton==3.8.0 nvidia-nccl-cu13==2.32.6 torchvision==0.29.0
  nvidia-cutlass-dsl==4.5.3 nvidia-cutlass-dsl-libs-base==4.5.3 quack-kernels==0.5.0
  torch-c-dlpack-ext==0.1.5 einops==0.8.2
  cuda-python==13.4.4 cuda-bindings==13.4.4 cuda-pathfinder==1.9.1
  lm-format-enforcer==0.11.3 outlines_core==0.2.14 lark==1.2.2 xgrammar==0.2.8
  compressed-tensors==0.17.0 depyf==0.20.0 apache-tvm-ffi==0.1.11 nvtx==0.2.15
  cachetools==8.0.3 blake3==1.0.11 py-cpuinfo==9.0.0
  tokenizers==0.23.3 protobuf==7.36.2 starlette==1.10.0 openai==3.63.0 pydantic==2.14.4
  pydantic_core==2.50.5 orjson==3.13.0 prometheus-fastapi-instrumentator==8.1.0
  llguidance==1.7.6 partial-json-parser==0.2.1.1.post7 jsonschema==4.26.0 pyzmq==27.3.0
  msgspec==0.23.0 watchfiles==1.3.0 python-json-logger==4.2.0 pybase64==1.5.1
  cbor2==6.3.0 ijson==3.6.0 setproctitle==1.3.8 oss-harmony==0.0.11 anthropic==2.17.0
  model-hosting-container-standards==0.1.16 mcp==2.3.0 mcp-types==2.3.0
  opentelemetry-sdk==1.45.2 opentelemetry-api==1.45.2
  opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-otlp==1.45.2
  opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2
  opentelemetry-exporter-otlp-common==0.66b2 opentelemetry-exporter-otlp-proto-common==1.45.2
  opentelemetry-proto==1.45.2 opentelemetry-semantic-conventions-ai==0.5.1
  opentelemetry-exporter-http-transport==0.66b2
  annotated-types==0.8.0 anyio==4.16.0 click==8.5.1 docstring_parser==0.18.0
  email-validator==2.4.0 fastar==0.12.0 httpx2==2.17.0 httpcore2==2.17.0
  interegular==0.3.3 jiter==0.19.0 jsonschema-specifications==2025.9.1 packaging==26.4
  pydantic-extra-types==2.11.1 pydantic-settings==2.16.3 python-multipart==0.0.34
  referencing==0.37.0 requests==2.34.2 rpds-py==2026.9.1 sniffio==1.3.1
  sse-starlette==3.7.1 supervisor==4.3.0 typing_extensions==4.16.0
  typing-inspection==0.4.5 uvicorn==0.55.0 astor==0.8.1 dill==0.4.1 fastapi==0.136.3
  jmespath==1.1.0 loguru==0.7.3 mistral_common==1.13.1 certifi==2026.10.19.post1
  cryptography==51.0.1 dnspython==2.9.2 fastapi-cloud-cli==0.28.0
  googleapis-common-protos==1.76.0 httptools==0.9.0 kernels==0.19.1 pycountry==26.2.16
  python-dotenv==1.2.4 rich-toolkit==0.20.6 truststore==0.10.5 urllib3==2.8.0
  uvloop==0.23.0 websockets==17.4 fastapi-cli==0.0.34 PyJWT==2.15.1
  agent-detector==2.0.0 cffi==2.1.1 detect-installer==0.2.1 rignore==0.8.1
  sentry-sdk==2.76.0 tomlkit==0.15.3 pycparser==3.12
)
# ray's Requires-Dist (no extra): click, filelock, msgpack, packaging>=24.2, protobuf,
# pyyaml, requests are in the device image (KINDS.md); jsonschema is not, nor its
# jsonschema-specifications, referencing, rpds-py (attrs and typing-extensions are).
RAY_EXTRA=(
  ray==2.60.0
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
  rpds-py==2026.9.1
)

fetch() {  # fetch DIR SPEC...: each wheel once
  local dir=$1 spec name norm; shift
  mkdir -p "$dir"
  for spec in "$@"; do
    name=${spec%%==*}
    norm=$(echo "$name" | tr '-' '_' | tr 'A-Z' 'a-z')
    if ls "$dir" 2>/dev/null | tr 'A-Z' 'a-z' | grep -q "^${norm}-${spec##*==}-"; then
      continue
    fi
    $PIP download -q "${COMMON[@]}" -d "$dir" "$spec"
  done
}
if [ "$VLLM" = 0.34 ]; then
  fetch .whl-034 "${EXTRA_034[@]}"
  rm -f .carry/v034-*
  mkdir -p .carry
  tar -C .whl-034 -cf .carry/v034-wheels.tar .
  ( cd .carry && split -b "$PIECE_BYTES" -d -a 2 v034-wheels.tar v034-piece- )
  ( cd .carry && sha256sum v034-wheels.tar v034-piece-* > v034-MANIFEST && rm v034-wheels.tar )
  echo "v034 pieces: $(ls .carry/v034-piece-* | wc -l)"
  exit 0
fi
fetch .whl "${EXTRA[@]}"
if [ "${RAY:-0}" = 1 ]; then
  fetch .whl-ray "${RAY_EXTRA[@]}"
fi

# The rolloutcore package itself travels with the working tree (src/), but its
# entry points (vllm.general_plugins) must be installed where vLLM looks:
# install_on_device.sh builds a tiny dist-info for it there; nothing to do here.

rm -f .carry/piece-* .carry/MANIFEST .carry/ray-* && mkdir -p .carry
tar -C .whl -cf .carry/wheels.tar .
( cd .carry && split -b "$PIECE_BYTES" -d -a 2 wheels.tar piece- )
( cd .carry && sha256sum wheels.tar piece-* > MANIFEST && rm wheels.tar )
if [ "${RAY:-0}" = 1 ]; then
  tar -C .whl-ray -cf .carry/ray-wheels.tar .
  ( cd .carry && split -b "$PIECE_BYTES" -d -a 2 ray-wheels.tar ray-piece- )
  ( cd .carry && sha256sum ray-wheels.tar ray-piece-* > ray-MANIFEST && rm ray-wheels.tar )
  ls -l .whl-ray
fi
ls -l .carry
echo "pieces: $(ls .carry/piece-* | wc -l)"
if [ "${RAY:-0}" = 1 ]; then
  echo "ray pieces: $(ls .carry/ray-piece-* | wc -l)"
  # Each piece travels with the working tree (tracked and untracked, not ignored):
  # the two together must stay under the 64 MiB of one device call.
  tree=$( { git ls-files -z; git ls-files -z -o --exclude-standard; } | xargs -0 du -cb \
          | awk '$2 == "total" {s += $1} END {print s + 0}')
  # The last call carries the last vLLM piece and the last ray piece together (one
  # extra call for ray, not two): h200_fleet.py --plan --ray lists the calls.
  big=$(stat -c %s .carry/ray-piece-* | sort -n | tail -1)
  last=$(( $(stat -c %s "$(ls .carry/piece-* | tail -1)") \
         + $(stat -c %s "$(ls .carry/ray-piece-* | tail -1)") ))
  lim=$((64 * 1024 * 1024))
  echo "working tree ${tree} B + largest ray piece ${big} B = $((tree + big)) B;" \
       "+ last vLLM and ray pieces ${last} B = $((tree + last)) B (limit ${lim} B)"
  [ $((tree + big)) -lt $lim ] && [ $((tree + last)) -lt $lim ] \
    || { echo "too large for one call: lower PIECE_BYTES" >&2; exit 1; }
fi
