#!/usr/bin/env bash
# On the H200 (no network): join the carried pieces, check them, install the
# wheels into /tmp/site, and make rolloutcore's vLLM plugin visible there.
#
# Expects every .carry/piece-NN and .carry/MANIFEST already copied into
# /tmp/rc-carry by earlier calls (see diagnostics/gpu/README.md). Run from the
# repository root; then: export PYTHONPATH=/tmp/site:$PWD/src
# Where ray-MANIFEST or any ray-piece-NN is there too (prepare_carry.sh with RAY=1),
# ray and its wheels are joined, checked against ray-MANIFEST and installed with them.
set -euo pipefail
# PREFIX=v034- SITE=/tmp/site034: the vLLM 0.34 carry (prepare_carry.sh with VLLM=0.34),
# into its own site so that 0.26 (the image's torch) and 0.34 (torch 2.14) run side by side.
CARRY=${CARRY:-/tmp/rc-carry}
SITE=${SITE:-/tmp/site}
PREFIX=${PREFIX:-}
cd "$CARRY"
cat "${PREFIX}"piece-* > "${PREFIX}wheels.tar"
# MANIFEST lists wheels.tar and every piece: all must match what was prepared.
sha256sum -c --quiet "${PREFIX}MANIFEST"
WHL=/tmp/rc-whl${PREFIX:+-${PREFIX%-}}
rm -rf "$WHL" && mkdir -p "$WHL" && tar -C "$WHL" -xf "${PREFIX}wheels.tar"
rm -f "${PREFIX}wheels.tar"
WHEELS=("$WHL"/*.whl)
RAY_CARRIED=0
if compgen -G 'ray-piece-*' >/dev/null || [ -e ray-MANIFEST ]; then
  RAY_CARRIED=1
  cat ray-piece-* > ray-wheels.tar
  sha256sum -c --quiet ray-MANIFEST   # a missing or partial ray piece stops here
  rm -rf /tmp/rc-whl-ray && mkdir -p /tmp/rc-whl-ray && tar -C /tmp/rc-whl-ray -xf ray-wheels.tar
  WHEELS+=(/tmp/rc-whl-ray/*.whl)
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" "${WHEELS[@]}"
# A --target site on PYTHONPATH is not a site directory: Python never runs its .pth
# files, and nvidia-cutlass-dsl (vLLM 0.34's engine core imports `cutlass`) puts its
# module on sys.path only through one. This sitecustomize (found first on PYTHONPATH,
# in every vLLM process) processes them, as a site directory would.
if compgen -G "$SITE/*.pth" >/dev/null; then
  printf 'import os, site\nsite.addsitedir(os.path.dirname(os.path.abspath(__file__)))\n' \
    > "$SITE/sitecustomize.py"
fi
# rolloutcore itself runs from the checkout (src/ on PYTHONPATH); vLLM finds
# its plugin through this entry point (the one pyproject declares for it).
DI="$SITE/rolloutcore_gpu_plugin-0.0.0.dist-info"
mkdir -p "$DI"
printf 'Metadata-Version: 2.1\nName: rolloutcore-gpu-plugin\nVersion: 0.0.0\n' > "$DI/METADATA"
printf '[vllm.general_plugins]\nrolloutcore = rolloutcore.transports.vllm_plugin:register\n' \
  > "$DI/entry_points.txt"
: > "$DI/RECORD"
echo "installed into $SITE: ${#WHEELS[@]} wheels"
if [ "$RAY_CARRIED" = 1 ]; then
  PYTHONPATH="$SITE" python3 -c 'import ray; print("ray", ray.__version__, "importable")'
fi
