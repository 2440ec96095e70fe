#!/usr/bin/env bash
# The GPU lane: benchmarks/gpu/run.sh OUT_DIR [CHECK ...]   (README.md beside this file)
#
# Installs this working tree (no network), runs every check with its own time limit and
# writes OUT_DIR/results.json, OUT_DIR/lane.log and OUT_DIR/gpu_lane_ckpt.tar.gz. Without a CUDA
# device it says so in one line and exits 0 after a dry run of its plumbing. PYTHON picks the
# interpreter (default python3); GPU_LANE_BUDGET the lane's seconds in all (default 540).
set -u
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ $# -lt 1 ]; then
    echo "usage: $0 OUT_DIR [CHECK ...]" >&2
    exit 2
fi
out="$1"
shift
mkdir -p "$out" || exit 2
out="$(cd "$out" && pwd)"
cd "$here/../.." || exit 2
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" "$here/lane.py" "$out" "$@"
