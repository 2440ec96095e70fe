"""The GPU lane's in-process checks, each run by lane.py in a process of its own:

    python benchmarks/gpu/inproc.py CHECK --result FILE --seconds S [--dry]

- ``step`` (step_check.py): distrun's loop against a hand-written loop on the same device,
  in this process, alternating, for tiny_gpt (examples/tiny_gpt.py) and a ~100M GPT of the
  same code, eager and with ``--compile``; steps/s timed between two device synchronizations
  (the end of the warm-up step and of the last step), as benchmarks/step_overhead.py does on
  the CPU;
- ``amp`` (amp_check.py): ``bf16-mixed`` and ``16-mixed`` (GradScaler, one step forced to
  overflow) against a hand-written autocast loop: losses, scales, optimizer steps and final
  weights;
- ``ckpt`` (ckpt_check.py): checkpoint save and load of GPU state (~1 GB) against DCP and
  ``torch.save``, and the async save's stall against a plain device-to-host copy into pinned
  memory (the pieces of benchmarks/checkpoint.py);
- ``tier`` (tier_check.py): the memory tier's in-place saves of GPU state (~1 GB) into files
  registered with CUDA against pageable ones, and against a pinned device-to-host copy.

FILE is rewritten after every measurement, so a check stopped at its time limit still leaves
what it measured (inproc_common.py's Result). ``--dry`` runs the same code on the CPU at the
smallest sizes.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.join(REPO, "benchmarks"), os.path.join(REPO, "examples"), HERE]

from amp_check import check_amp  # noqa: E402
from ckpt_check import check_ckpt  # noqa: E402
from inproc_common import Result  # noqa: E402
from step_check import check_step  # noqa: E402
from tier_check import check_tier  # noqa: E402

CHECKS = {"step": check_step, "amp": check_amp, "ckpt": check_ckpt, "tier": check_tier}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=sorted(CHECKS))
    parser.add_argument("--result", required=True, help="the JSON file of figures")
    parser.add_argument("--seconds", type=float, default=120.0, help="this check's budget")
    parser.add_argument("--dry", action="store_true", help="CPU, smallest sizes")
    args = parser.parse_args(argv)
    res = Result(args.result, args.seconds)
    res.write()
    CHECKS[args.check](res, args.dry)
    res.write()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
