#!/usr/bin/env bash
# Download, here (where pip reaches a registry), the wheels the GPU machine lacks into
# benchmarks/gpu/wheels/ (git-ignored); the device call carries that folder and the lane
# installs them with --no-index. The machine runs CPython 3.12 on x86-64.
#   crc32c    distrun-safetensors' checksums (a compiled extension: the cp312 manylinux wheel)
#   torchdata the core's StatefulDataLoader (pure Python; only an IterableDataset needs it)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dest="$here/wheels"
mkdir -p "$dest"
"${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 -d "$dest" crc32c==2.9.post0 torchdata==0.11.0
ls -l "$dest"
