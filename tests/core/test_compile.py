"""--compile: torch.compile after the strategy's wrapping; same losses, clean keys."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from distrun import Trainer
from distrun.testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from tiny_task import TinyTask  # noqa: E402


def _fit(rank, world, run_dir, strategy, compile):
    with Trainer(run_dir=run_dir, strategy=strategy, compile=compile, max_steps=6,
                 batch_size=32, log_every_n_steps=2, summary=False) as trainer:
        run = trainer.fit(TinyTask())
        return run.metrics["loss"], sorted(run.unwrapped_model().state_dict()), \
            sorted(run.model.state_dict())


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_compiled_training_matches_eager_and_keeps_clean_keys(tmp_path, strategy):
    pytest.importorskip(f"distrun_{strategy}", reason=f"needs distrun-{strategy}")
    eager = run_on_ranks(_fit, 2, str(tmp_path / "e"), strategy, False, timeout=300)
    compiled = run_on_ranks(_fit, 2, str(tmp_path / "c"), strategy, True, timeout=300)
    for e, c in zip(eager, compiled):
        assert c[0] == pytest.approx(e[0], rel=1e-5)
        assert c[1] == e[1] and c[2] == e[2]
        assert not any("_orig_mod" in k for k in c[1] + c[2])
