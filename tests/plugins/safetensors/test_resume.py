"""Resume through the Trainer and the hooks: bit-identical at the same world size (dropout, AdamW,
an LR schedule), the same global sample at another one; async saves; cadence and retention."""

from __future__ import annotations

import os

import st_plugin
import torch
from st_task import Task

from distrun.testing import run_on_ranks

COMMON = dict(strategy="st_ddp", batch_size=8, seed=3, max_epochs=3, log_every_n_steps=100,
              summary=False)


def _weights(run):
    return {k: v.detach().clone() for k, v in run.unwrapped_model().state_dict().items()}


def _fit(**options):
    from distrun import Trainer

    return Trainer(plugins=(st_plugin,), **{**COMMON, **options}).fit(Task())


def rank_resume(rank, world, root):
    """Uninterrupted 12 steps vs 5 steps + resume; also an async run with cadence saves."""
    whole = _fit(run_dir=f"{root}/whole", max_steps=12)
    _fit(run_dir=f"{root}/cut", max_steps=5, ckpt_save_on_end=True)
    resumed = _fit(run_dir=f"{root}/cut", max_steps=12, resume="latest")
    snapshot = {}

    class AtStep6:
        @staticmethod
        @__import__("distrun").hookimpl
        def distrun_on_step_end(run, step):
            if step == 6:
                snapshot.update(_weights(run))

    from distrun import Trainer

    cadence = Trainer(plugins=(st_plugin, AtStep6()), **COMMON, run_dir=f"{root}/async",
                      max_steps=7, ckpt_every_n_steps=2, ckpt_async=True, ckpt_keep_last=2,
                      ckpt_save_on_end=True).fit(Task())
    # the async save of step 6 holds step 6's weights although training went on to step 7
    from distrun_safetensors import load_checkpoint

    async_ok = {}
    for step, want in ((6, snapshot), (7, _weights(cadence))):
        model = Task().configure_model()
        load_checkpoint(f"{root}/async/checkpoints/step-{step}", model)
        async_ok[step] = all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    return {"whole": _weights(whole), "resumed": _weights(resumed), "async_ok": async_ok,
            "resumed_from": resumed.resumed_from, "cadence_step": cadence.progress.step,
            "whole_lr": whole.optimizer.param_groups[0]["lr"],
            "resumed_lr": resumed.optimizer.param_groups[0]["lr"]}


def test_resume_is_bit_identical_and_resumes_elsewhere_at_the_same_sample(tmp_path, cpu_backend):
    root = str(tmp_path)
    results = run_on_ranks(rank_resume, 2, root, init_process_group=True, timeout=240,
                           backend=cpu_backend)
    for rank, r in enumerate(results):
        assert r["resumed_from"].endswith(os.path.join("cut", "checkpoints", "step-5")), r
        assert r["whole_lr"] == r["resumed_lr"]
        for k, v in r["whole"].items():
            assert torch.equal(v, r["resumed"][k]), f"rank {rank}: {k} differs after resume"
    assert all(r["async_ok"] == {6: True, 7: True} for r in results), \
        [r["async_ok"] for r in results]
    # async cadence: steps 2, 4, 6 and the end (7); keep_last=2 leaves the two newest
    ckpts = sorted(os.listdir(tmp_path / "async" / "checkpoints"))
    assert ckpts == [".generation", "latest", "step-6", "step-7"], ckpts

    # another world size: the 2-rank checkpoint of step 5 in one process continues from
    # global sample 5 * 8 = 40 of epoch 0 (the sampler cursor), with step 5's weights
    seen = {}

    class Probe:
        @staticmethod
        @__import__("distrun").hookimpl
        def distrun_on_fit_start(run):
            seen.update(cursor=run.sampler.cursor, epoch=run.sampler.epoch,
                        step=run.progress.step, local_batch=run.sampler.local_batch,
                        weights=_weights(run))

    from distrun import Trainer

    run = Trainer(plugins=(st_plugin, Probe()), **{**COMMON, "strategy": "single"},
                  run_dir=str(tmp_path / "one"), max_steps=6,
                  resume=str(tmp_path / "cut" / "checkpoints" / "step-5")).fit(Task())
    assert (seen["cursor"], seen["epoch"], seen["step"]) == (40, 0, 5)
    assert seen["local_batch"] == 8 and run.progress.step == 6
    from safetensors import safe_open

    folder = tmp_path / "cut" / "checkpoints" / "step-5"
    assert any(n.startswith("model-00002-of-00002") for n in os.listdir(folder))
    with safe_open(str(folder / "model-00001-of-00002.safetensors"), "pt") as f:
        assert len(list(f.keys())) >= 1


def test_time_cadence_and_on_demand_save_in_one_process(tmp_path):
    run = _fit(strategy="single", run_dir=str(tmp_path / "t"), max_steps=3,
               ckpt_every_n_seconds=1e-9, ckpt_keep_last=0)
    ckpts = tmp_path / "t" / "checkpoints"
    assert sorted(os.listdir(ckpts)) == [".generation", "latest", "step-1", "step-2", "step-3"]
    # on demand at a step already saved: the committed folder, not a second write
    assert run.save_checkpoint("user") == str(ckpts / "step-3")


class _Marked(Task):
    """Draws one number right after building the model: the seed's first draw when the build's
    random initialization was skipped (a resume), another one when it ran."""

    random_buffer = False

    def configure_model(self):
        model = super().configure_model()
        if self.random_buffer:  # drawn at random, used by the steps, not in the state_dict
            model.register_buffer("mix", torch.empty(6).normal_(), persistent=False)
        self.after_build = torch.rand(1).item()
        return model

    def training_step(self, model, batch):
        x, y = batch
        if self.random_buffer:
            x = x * model.mix
        return torch.nn.functional.mse_loss(model(x), y)


def rank_skipped_init(rank, world, root, random_buffer):
    from distrun import Trainer

    def fit(name, **options):
        task = _Marked()
        task.random_buffer = random_buffer
        run = Trainer(plugins=(st_plugin,), **{**COMMON, **options},
                      run_dir=f"{root}/{name}").fit(task)
        return run, task

    whole, whole_task = fit("whole", max_steps=10)
    _, first_task = fit("cut", max_steps=4, ckpt_save_on_end=True)
    resumed, resumed_task = fit("cut", max_steps=10, resume="latest")
    torch.manual_seed(COMMON["seed"])
    seeded = torch.rand(1).item()
    buffers = {n: dict(r.unwrapped_model().named_buffers()).get("mix", torch.empty(0)).clone()
               for n, r in (("whole", whole), ("resumed", resumed))}
    return {"whole": _weights(whole), "resumed": _weights(resumed), "buffers": buffers,
            "skipped": {"whole": whole_task.after_build == seeded,
                        "first": first_task.after_build == seeded,
                        "resumed": resumed_task.after_build == seeded},
            "resumed_from": resumed.resumed_from}


def test_a_resume_builds_the_model_without_its_random_init_and_ends_bit_identical(tmp_path):
    # the checkpoint overwrites every tensor of the model's state: its random draws are skipped
    results = run_on_ranks(rank_skipped_init, 2, str(tmp_path), False, init_process_group=True,
                           timeout=240)
    for rank, r in enumerate(results):
        assert r["resumed_from"].endswith(os.path.join("cut", "checkpoints", "step-4")), r
        assert r["skipped"] == {"whole": False, "first": False, "resumed": True}, (rank, r)
        for k, v in r["whole"].items():
            assert torch.equal(v, r["resumed"][k]), f"rank {rank}: {k} differs after resume"


def test_a_random_buffer_the_checkpoint_lacks_makes_a_resume_initialize_the_model(tmp_path):
    # the buffer `mix` is drawn in configure_model and not saved: skipping its draw would leave
    # uninitialized memory, so the model is built again the ordinary way (the same draws)
    results = run_on_ranks(rank_skipped_init, 2, str(tmp_path), True, init_process_group=True,
                           timeout=240)
    for rank, r in enumerate(results):
        assert r["skipped"] == {"whole": False, "first": False, "resumed": False}, (rank, r)
        assert torch.equal(r["buffers"]["whole"], r["buffers"]["resumed"]), rank
        assert r["buffers"]["whole"].numel() == 6
        for k, v in r["whole"].items():
            assert torch.equal(v, r["resumed"][k]), f"rank {rank}: {k} differs after resume"


class _Promises:
    """A checkpoint plugin that says a checkpoint will be loaded, and loads none."""

    @staticmethod
    @__import__("distrun").hookimpl
    def distrun_checkpoint_found(run, source):
        return True


def test_a_promised_load_that_loads_nothing_is_an_error_not_a_fresh_start(tmp_path, capsys):
    from distrun import Trainer

    trainer = Trainer(plugins=(st_plugin, _Promises()), **{**COMMON, "strategy": "single"},
                      run_dir=str(tmp_path / "r"), max_steps=2, resume="auto")
    try:
        trainer.fit(Task())
    except SystemExit as exc:
        assert exc.code == 1
    else:
        raise AssertionError("the fit went on from an uninitialized model")
    assert "its load restored none, so the model holds uninitialized memory" in \
        capsys.readouterr().err
