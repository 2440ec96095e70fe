"""distrun-pipeline: parity with one process, 2D compositions, checkpoints, bad configurations.

Real gloo ranks (spawned processes) against the same fit in this process under ``single``.
Tolerance: 1e-5 absolute on losses and weights (float32; the pipeline computes each
micro-batch's mean loss and averages them, the single run one mean over the batch, so the
sums differ in rounding only: ~1e-7 per step, measured).
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from distrun.testing import free_port, run_cli, run_on_ranks

sys.path.insert(0, os.path.dirname(__file__))  # pp_tasks, importable by spawned ranks too
from pp_tasks import PLUGINS, max_diff, merged, reference, train_many  # noqa: E402

TOL = 1e-5
# a loaded 2-core machine needs minutes for the spawned fits
pytestmark = pytest.mark.timeout(900)
CKPT_PLUGINS = ",".join([PLUGINS, "distrun_safetensors.plugin", "distrun_ddp.plugin",
                         "distrun_fsdp.plugin"])


def _check_parity(ref: dict, out: list[dict], steps: int) -> None:
    assert len(ref["losses"]) == steps
    for rank_out in out:  # every rank logs the last stage's loss
        assert rank_out["losses"] == pytest.approx(ref["losses"], abs=TOL)
        assert rank_out["val"] == pytest.approx(ref["val"], abs=TOL)
    assert max_diff(ref["state"], merged(out)) < TOL


def test_pp_sequential_matches_one_process(tmp_path: Path) -> None:
    """An nn.Sequential split by parameter count, 1F1B over 2 ranks: loss, validation, weights."""
    opts = dict(max_steps=8, val_every_n_steps=8)
    ref = reference("seq", dict(opts, run_dir=str(tmp_path / "single")))
    out = run_on_ranks(train_many, 2, [("seq", dict(opts, strategy="pp", run_dir=str(
        tmp_path / "pp"), port=free_port()))], timeout=240)
    out = [o[0] for o in out]
    _check_parity(ref, out, 8)
    assert [o["dp"] for o in out] == [(0, 1), (0, 1)]  # both stages read the same batch
    # each rank holds its stage only, under the model's own (global) names
    assert "0.weight" in out[0]["state"] and "0.weight" not in out[1]["state"]
    assert "14.weight" in out[1]["state"] and "14.weight" not in out[0]["state"]


@pytest.mark.slow
def test_a_decoder_shaped_like_transformers_matches_one_process(tmp_path: Path) -> None:
    """What a transformers causal LM does under pp: dict batches (input_ids, labels), positions
    from the embedding's shape on every stage, a stateless rotary embedding registered after
    the layers but called before them (kept by every stage, not cut), and a mapping output
    whose non-tensor (a cache) is dropped while the task's steps still index `["logits"]`.
    Then with the head tied to the token embedding (GPT-2's way) and the output shaped by the
    input's shape: both end stages hold the weight, their gradients summed (and counted once
    when clipping), the weights stay equal to one process's (and to each other)."""
    runs = {"decoder": dict(max_steps=8, val_every_n_steps=8),
            # clipping: the tied weight's gradient counts once in the global norm
            "decoder-tied": dict(max_steps=8, val_every_n_steps=8, grad_clip=0.5)}
    refs = [reference(name, dict(opts, run_dir=str(tmp_path / f"single-{name}")))
            for name, opts in runs.items()]
    out = run_on_ranks(train_many, 2, [(name, dict(opts, strategy="pp", run_dir=str(
        tmp_path / f"pp-{name}"), port=free_port())) for name, opts in runs.items()],
        timeout=240)
    for i, ref in enumerate(refs):
        _check_parity(ref, [o[i] for o in out], 8)
    assert "model.embed_tokens.weight" in out[0][0]["state"]
    assert "model.embed_tokens.weight" not in out[1][0]["state"]
    tied = [o[1]["state"] for o in out]  # both ranks hold the tied weight, equal
    assert tied[0]["lm_head.weight"] == tied[1]["model.embed_tokens.weight"]


@pytest.mark.slow
def test_every_schedule_matches_one_process(tmp_path: Path, cpu_backend: str) -> None:
    """The tiny GPT over 20 steps under each schedule; gradient accumulation and clipping."""
    base = dict(max_steps=20, val_every_n_steps=10)
    variants = {"gpipe": dict(grad_accum=2), "1f1b": dict(grad_clip=0.5),
                "interleaved-1f1b": dict(), "zero-bubble": dict(grad_clip=0.5)}
    refs = {}
    for extra in ({}, {"grad_accum": 2}, {"grad_clip": 0.5}):
        key = tuple(sorted(extra.items()))
        refs[key] = reference("gpt", dict(base, **extra, run_dir=str(tmp_path / f"ref{key}")))
    runs = [("gpt", dict(base, **extra, strategy="pp", pp_schedule=name, port=free_port(),
                         run_dir=str(tmp_path / name))) for name, extra in variants.items()]
    per_rank = run_on_ranks(train_many, 2, runs, timeout=600, backend=cpu_backend)
    for i, extra in enumerate(variants.values()):
        ref = refs[tuple(sorted(extra.items()))]
        _check_parity(ref, [r[i] for r in per_rank], 20)


@pytest.mark.slow
def test_pp_ddp_and_pp_fsdp_on_four_ranks(tmp_path: Path, cpu_backend: str) -> None:
    """2 stages x 2 data-parallel replicas (DDP), and x 2 shards (FSDP2), match one process;
    and under pp+ddp a head tied to the token embedding (summed over the stages after DDP's
    average over the replicas)."""
    opts = dict(max_steps=20, val_every_n_steps=10, grad_clip=0.5)
    ref = reference("gpt", dict(opts, run_dir=str(tmp_path / "single")))
    tied = dict(max_steps=8, val_every_n_steps=8, grad_clip=0.5)
    ref_tied = reference("decoder-tied", dict(tied, run_dir=str(tmp_path / "single-tied")))
    runs = [("gpt", dict(opts, strategy=name, pp=2, port=free_port(),
                         run_dir=str(tmp_path / name.replace("+", "-"))))
            for name in ("pp+ddp", "pp+fsdp")]
    runs.append(("decoder-tied", dict(tied, strategy="pp+ddp", pp=2, port=free_port(),
                                      run_dir=str(tmp_path / "tied"))))
    per_rank = run_on_ranks(train_many, 4, runs, timeout=600, backend=cpu_backend)
    for i, (reference_run, steps) in enumerate([(ref, 20), (ref, 20), (ref_tied, 8)]):
        out = [r[i] for r in per_rank]
        _check_parity(reference_run, out, steps)
        # mesh pp x dp: ranks 0,1 are stage 0 (data ranks 0,1), ranks 2,3 stage 1
        assert [o["dp"] for o in out] == [(0, 2), (1, 2), (0, 2), (1, 2)]


@pytest.mark.slow
def test_bf16_autocast_from_distrun_amp(tmp_path: Path) -> None:
    """distrun-amp's bf16 autocast wraps the pipeline's step: the losses follow the one-process
    bf16 run (to bf16's precision: micro-batches change the kernels' blocking)."""
    pytest.importorskip("distrun_amp")
    opts = dict(max_steps=8, precision="bf16-mixed", plugins="distrun_amp.plugin")
    ref = reference("seq", dict(opts, run_dir=str(tmp_path / "single")))
    out = run_on_ranks(train_many, 2, [("seq", dict(
        opts, strategy="pp", plugins=f"{PLUGINS},distrun_amp.plugin", port=free_port(),
        run_dir=str(tmp_path / "pp")))], timeout=300)
    assert out[0][0]["losses"] == pytest.approx(ref["losses"], abs=2e-2)
    assert out[0][0]["losses"] != pytest.approx(
        reference("seq", dict(max_steps=8, run_dir=str(tmp_path / "fp32")))["losses"], abs=1e-6)


@pytest.mark.slow
def test_uneven_inputs_across_data_parallel_groups_end_without_a_hang(tmp_path: Path) -> None:
    """pp+ddp, 4 ranks, per-rank iterables of 6 and 4 batches: with distrun-join every rank
    trains the shorter count (its `agree` mode: the pipeline's stages are not Joinable)."""
    pytest.importorskip("distrun_join")
    out = run_on_ranks(train_many, 4, [("uneven", dict(
        strategy="pp+ddp", pp=2, max_epochs=2, max_steps=-1, port=free_port(),
        plugins=f"{PLUGINS},distrun_join.plugin", run_dir=str(tmp_path / "run")))],
        timeout=300)
    assert [len(o[0]["losses"]) for o in out] == [8, 8, 8, 8]  # 2 epochs x 4 steps
    assert len({tuple(o[0]["losses"]) for o in out}) == 1


@pytest.mark.slow
def test_checkpoints_load_across_layouts(tmp_path: Path) -> None:
    """Saved under pp (2 stages): loads bit-equal under single, ddp, fsdp and pp with 4
    stages; saved under single and under fsdp (2 shards): loads bit-equal under pp."""
    a, b, c = tmp_path / "pp-ckpt", tmp_path / "single-ckpt", tmp_path / "fsdp-ckpt"
    train = dict(max_steps=6, ckpt_save_on_end=True, plugins=CKPT_PLUGINS)
    saved_b = reference("gpt-adam", dict(train, ckpt_dir=str(b), run_dir=str(tmp_path / "sb"),
                                         plugins="distrun_safetensors.plugin"))

    def evaluate(strategy: str, source: Path, **extra: object) -> tuple[str, dict]:
        return ("gpt-adam", dict(stage="validate", resume=str(source), strategy=strategy,
                                 plugins=CKPT_PLUGINS, port=free_port(),
                                 run_dir=str(tmp_path / f"eval-{strategy}-{source.name}"),
                                 **extra))

    runs = [("gpt-adam", dict(train, strategy="pp", ckpt_dir=str(a), port=free_port(),
                              run_dir=str(tmp_path / "pa"))),
            ("gpt-adam", dict(train, strategy="fsdp", ckpt_dir=str(c), port=free_port(),
                              run_dir=str(tmp_path / "fc"))),
            evaluate("pp", a, pp_schedule="interleaved-1f1b"),
            evaluate("ddp", a), evaluate("fsdp", a),
            evaluate("pp", b, pp_schedule="gpipe"), evaluate("pp", c)]
    per_rank = run_on_ranks(train_many, 2, runs, timeout=600)
    saved_a = merged([r[0] for r in per_rank])
    single_a = reference("gpt-adam", dict(stage="validate", resume=str(a),
                                          run_dir=str(tmp_path / "ea"),
                                          plugins="distrun_safetensors.plugin"))
    assert max_diff(saved_a, single_a["state"]) == 0.0
    assert max_diff(saved_a, merged([r[2] for r in per_rank])) == 0.0  # pp, 4 stages
    assert max_diff(saved_a, per_rank[0][3]["state"]) == 0.0  # ddp
    assert max_diff(saved_a, per_rank[0][4]["state"]) == 0.0  # fsdp (gathered)
    assert max_diff(saved_b["state"], merged([r[5] for r in per_rank])) == 0.0  # single -> pp
    assert max_diff(per_rank[0][1]["state"], merged([r[6] for r in per_rank])) == 0.0  # fsdp
    # and the validation loss of the loaded weights agrees across the layouts
    vals = [single_a["val"][0]] + [per_rank[0][i]["val"][0] for i in (2, 3, 4)]
    assert vals == pytest.approx([vals[0]] * 4, abs=TOL)


@pytest.mark.slow
def test_kill_and_resume_is_bit_exact(tmp_path: Path) -> None:
    """A pp run killed after step 6 resumes from its step-4 checkpoint and ends with the weights
    of the uninterrupted run, bit for bit (AdamW state, RNG and data cursor restored)."""
    opts = dict(max_steps=10, strategy="pp", plugins=CKPT_PLUGINS)
    whole = run_on_ranks(train_many, 2, [("gpt-adam", dict(
        opts, port=free_port(), run_dir=str(tmp_path / "whole")))], timeout=300)
    run_dir = str(tmp_path / "killed")
    with pytest.raises(AssertionError, match="exited with codes"):
        run_on_ranks(train_many, 2, [("gpt-adam", dict(
            opts, port=free_port(), run_dir=run_dir, ckpt_every_n_steps=4, kill_at=6))],
            timeout=300)
    resumed = run_on_ranks(train_many, 2, [("gpt-adam", dict(  # and saves again (step 8)
        opts, port=free_port(), run_dir=run_dir, resume="latest", ckpt_every_n_steps=4))],
        timeout=300)
    assert max_diff(merged([r[0] for r in whole]), merged([r[0] for r in resumed])) == 0.0
    assert resumed[0][0]["losses"] == whole[0][0]["losses"][4:]


ELASTIC_SCRIPT = """
import json, os, sys
sys.path.insert(0, {here!r})
import distrun
from pp_tasks import make_task, owned_state


class KillOnce:
    @distrun.hookimpl
    def distrun_on_step_end(self, run, step):
        if step == 5 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" \\
                and os.environ.get("PP_KILL"):
            os._exit(17)

    @distrun.hookimpl
    def distrun_on_fit_end(self, run):
        with open(os.path.join(run.run_dir, f"final-{{run.rank}}.json"), "w") as fh:
            json.dump(owned_state(run.unwrapped_model()), fh)


distrun.Trainer(plugins=(KillOnce(),), max_steps=8, batch_size=16).fit(make_task("gpt-adam"))
"""


@pytest.mark.slow
def test_elastic_restart_of_a_pp_run_resumes(tmp_path: Path) -> None:
    """Under distrun-elastic, a pp run whose ranks die after step 5 is restarted, resumes from
    its step-4 checkpoint and ends with the weights of an uninterrupted run."""
    pytest.importorskip("distrun_elastic")
    import json

    script = tmp_path / "elastic_task.py"
    script.write_text(ELASTIC_SCRIPT.format(here=os.path.dirname(__file__)))
    finals = {}
    for name, kill in (("whole", ""), ("killed", "1")):
        run_dir = tmp_path / name
        result = run_cli("run", "--max-restarts", "1", "--nproc-per-node", "2", "--strategy",
                         "pp", "--ckpt-every-n-steps", "4", "--run-dir", str(run_dir),
                         str(script), cwd=tmp_path, timeout=600,
                         env={"DISTRUN_BLOCK_PLUGINS": "wandb,mlflow", "PP_KILL": kill})
        assert result.returncode == 0, result
        finals[name] = {}
        for rank in (0, 1):
            finals[name].update(json.loads((run_dir / f"final-{rank}.json").read_text()))
    assert "restarting the workers" in result.stderr, result
    assert max_diff(finals["whole"], finals["killed"]) == 0.0


SCRIPT = """
import sys
sys.path.insert(0, {here!r})
import distrun
from pp_tasks import make_task

distrun.fit(make_task({task!r}), max_steps=2)
"""


def _bad(tmp_path: Path, task: str, *flags: str, nproc: int = 2) -> str:
    script = tmp_path / f"{task}_task.py"
    script.write_text(textwrap.dedent(SCRIPT.format(here=os.path.dirname(__file__), task=task)))
    result = run_cli("run", "--nproc-per-node", str(nproc), "--run-dir", str(tmp_path / "run"),
                     *flags, str(script), cwd=tmp_path,
                     env={"DISTRUN_BLOCK_PLUGINS": "wandb,mlflow", "TINY_GPT_LAYERS": "2"})
    assert result.returncode == 2, result
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert errors and "Traceback" not in result.output, result
    return errors[0]


def test_world_size_not_divisible_by_pp(tmp_path: Path) -> None:
    line = _bad(tmp_path, "seq", "--strategy", "pp+ddp", "--pp", "2", nproc=3)
    assert "--pp 2 does not divide the world size 3" in line


@pytest.mark.slow
@pytest.mark.parametrize("task, flags, says", [
    ("gpt", ("--pp-schedule", "interleaved-1f1b"), "4 stages but TinyGPT has only 2 blocks"),
    ("seq", ("--batch-size", "16", "--microbatches", "3"),
     "--microbatches 3 does not divide the per-rank batch 16"),
    ("nosplit", (), "pipeline cannot split Flat"),
    ("seq", ("--precision", "16-mixed"), "use --precision bf16-mixed"),
    # checked by the plugins that own these options, against the pipeline's PARALLEL_DIMS
    ("seq", ("--zero",), "--zero does not compose with pipeline parallel"),
    ("seq", ("--tp-size", "2"), "'pp' does not"),
])
def test_bad_configurations_exit_2_with_one_line(tmp_path: Path, task: str, flags: tuple,
                                                  says: str) -> None:
    for flag, plugin in (("--precision", "distrun_amp"), ("--zero", "distrun_zero"),
                         ("--tp-size", "distrun_tp")):
        if flag in flags:
            pytest.importorskip(plugin)
    assert says in _bad(tmp_path, task, "--strategy", "pp", *flags)
