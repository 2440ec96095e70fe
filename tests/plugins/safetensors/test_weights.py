"""--init-weights: Hugging Face safetensors weights (sharded folder or one file) loaded into
the model at the start of a fit, under every layout, one shard open at a time; bad input is
one line, exit 2, and changes nothing."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from st_layouts import MLP
from st_weights import rank_load_layouts, source_tensors, write_hf

from distrun.plugin import UsageError
from distrun.testing import run_cli, run_on_ranks
from distrun_safetensors import load_weights
from distrun_safetensors.weights import find_weights, observe_open

HERE = Path(__file__).resolve().parent
TASK = f"{HERE / 'st_task.py'}:Task"


def _fresh(seed: int = 3) -> MLP:
    torch.manual_seed(seed)
    return MLP()


def _equal(model: torch.nn.Module, want: dict[str, torch.Tensor]) -> list[str]:
    sd = model.state_dict()
    bad = sorted(set(sd) ^ set(want))
    return bad + [k for k in want if k in sd and not (
        sd[k].dtype == want[k].dtype and torch.equal(sd[k], want[k]))]


def test_sharded_folder_loads_bit_equal_one_shard_open_at_a_time(tmp_path):
    src = source_tensors()
    weight_map = write_hf(str(tmp_path / "hf"), src, shards=2)
    assert sorted(set(weight_map.values())) == ["model-00001-of-00002.safetensors",
                                                "model-00002-of-00002.safetensors"]
    shards = {os.path.realpath(tmp_path / "hf" / name) for name in weight_map.values()}
    held: list[set[str]] = []

    def holding(_path: str) -> set[str]:
        """The shard files this process has open or mapped right now (Linux /proc)."""
        fds = {os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")}
        maps = Path("/proc/self/maps").read_text()
        return {p for p in shards if p in fds or p in maps}

    model = _fresh()
    stop = observe_open(lambda path: held.append(holding(path)))
    try:
        result = load_weights(str(tmp_path / "hf"), model)
    finally:
        stop()
    assert _equal(model, src) == []
    # each shard opened once, in order; when one is opened, no other is open or mapped
    assert result.files_opened == sorted(set(weight_map.values())) and result.max_open == 1
    assert held == [{p} for p in sorted(shards)], held  # safe_open maps the file it opened
    assert holding("") == set()  # and none is left open afterwards
    assert result.bytes_read == sum(t.numel() * t.element_size() for t in src.values())
    assert result.missing == result.unexpected == result.mismatched == []
    # the index file itself works as the path too
    again = _fresh(4)
    load_weights(str(tmp_path / "hf" / "model.safetensors.index.json"), again)
    assert _equal(again, src) == []


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight


def test_single_file_prefix_cast_tied_and_partial(tmp_path):
    src = source_tensors()
    # HF's habit: the file's names carry `model.`, here in float16
    half = {f"model.{k}": v.to(torch.float16) for k, v in src.items()}
    write_hf(str(tmp_path / "one"), half, shards=1)
    with pytest.raises(UsageError) as info:
        load_weights(str(tmp_path / "one"), _fresh())
    msg = str(info.value)
    assert "\n" not in msg and "does not fit the model" in msg
    assert "missing from it: scale, fc1.weight" in msg and "model.fc1.weight" in msg
    assert msg.endswith("(--init-weights-prefix model. renames them)"), msg
    model = _fresh()
    result = load_weights(str(tmp_path / "one" / "model.safetensors"), model, prefix="model.")
    assert _equal(model, {k: v.to(torch.float16).to(src[k].dtype) for k, v in src.items()}) == []
    assert result.cast == {"F16 -> float32": 4, "F16 -> float64": 1}
    assert any("note: 4 tensor(s) cast F16 -> float32" in line for line in result.report())

    # the model's names carry a head the file lacks: `=head.` adds it
    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = _fresh()

    write_hf(str(tmp_path / "bare"), src, shards=2)
    with pytest.raises(UsageError, match=r"\(--init-weights-prefix =head\. renames them\)"):
        load_weights(str(tmp_path / "bare"), Wrapped())
    wrapped = Wrapped()
    load_weights(str(tmp_path / "bare"), wrapped, prefix="=head.")
    assert _equal(wrapped.head, src) == []

    # tied weights saved once (as save_pretrained does) load into both names
    tied_src = {"emb.weight": torch.randn(5, 3)}
    write_hf(str(tmp_path / "tied"), tied_src, shards=1)
    tied = Tied()
    result = load_weights(str(tmp_path / "tied"), tied)
    assert torch.equal(tied.head.weight, tied_src["emb.weight"])
    assert result.tied == ["head.weight = emb.weight"]

    # partial: fc2 missing, an extra tensor, a shape that differs
    partial = {k: v for k, v in src.items() if not k.startswith("fc2.")}
    partial["extra.weight"] = torch.ones(2)
    partial["scale"] = torch.zeros(4, dtype=torch.float64)
    write_hf(str(tmp_path / "partial"), partial, shards=2)
    before = _fresh()
    kept = {k: v.clone() for k, v in before.state_dict().items()}
    with pytest.raises(UsageError, match="--no-init-weights-strict loads the tensors"):
        load_weights(str(tmp_path / "partial"), before)
    assert _equal(before, kept) == []  # refused before anything was copied
    result = load_weights(str(tmp_path / "partial"), before, strict=False)
    sd = before.state_dict()
    assert torch.equal(sd["fc1.weight"], src["fc1.weight"])
    assert torch.equal(sd["fc2.weight"], kept["fc2.weight"]) and torch.equal(sd["scale"],
                                                                            kept["scale"])
    assert result.missing == ["fc2.weight", "fc2.bias"] and result.unexpected == ["extra.weight"]
    assert result.mismatched == ["scale: file [4] vs model [3]"]
    assert "  skipped, shapes differ: scale: file [4] vs model [3]" in result.report()


def _hf(tmp_path: Path) -> Path:
    folder = tmp_path / "hf"
    write_hf(str(folder), source_tensors(), shards=2)
    return folder


def _edit_index(folder: Path, fn) -> None:
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    fn(index)
    path.write_text(json.dumps(index))


def nothing_there(tmp_path):
    return tmp_path / "nope", "no such file or folder"


def empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty", "the folder has neither model.safetensors.index.json nor"


def index_not_json(tmp_path):
    folder = _hf(tmp_path)
    (folder / "model.safetensors.index.json").write_text("{not json")
    return folder, "model.safetensors.index.json is not valid JSON"


def index_without_weight_map(tmp_path):
    folder = _hf(tmp_path)
    _edit_index(folder, lambda index: index.pop("weight_map"))
    return folder, "no weight_map of tensor names to shard files"


def shard_missing(tmp_path):
    folder = _hf(tmp_path)
    os.unlink(folder / "model-00002-of-00002.safetensors")
    return folder, "model-00002-of-00002.safetensors is missing (the index names it)"


def key_not_in_its_shard(tmp_path):
    folder = _hf(tmp_path)
    _edit_index(folder, lambda index: index["weight_map"].update(
        {"fc1.weight": "model-00002-of-00002.safetensors"}))
    return folder, "tensor 'fc1.weight' named by model.safetensors.index.json is not in it"


def shard_escapes(tmp_path):
    folder = _hf(tmp_path)
    _edit_index(folder, lambda index: index["weight_map"].update(
        {"fc1.weight": "../model-00001-of-00002.safetensors"}))
    return folder, "is not a plain file name inside the folder"


def shard_truncated(tmp_path):
    folder = _hf(tmp_path)
    path = folder / "model-00001-of-00002.safetensors"
    os.truncate(path, os.path.getsize(path) - 3)
    return folder, "model-00001-of-00002.safetensors: data section is"


def a_distrun_checkpoint(tmp_path):
    from distrun_safetensors.save import Checkpointer

    path = Checkpointer(str(tmp_path / "ckpt")).save(1, MLP())
    return Path(path), "is a distrun checkpoint, not Hugging Face weights: resume it with"


def shapes_differ(tmp_path):
    src = source_tensors()
    src["fc1.weight"] = torch.zeros(7, 10)
    write_hf(str(tmp_path / "hf"), src)
    return tmp_path / "hf", "shapes differ: fc1.weight: file [7, 10] vs model [10, 7]"


# -- issue 26 item 4: no file of the folder is read through a link that leaves it, nor a FIFO --

LINKED = "is a link that leaves the weights folder (refusing to read it)"


def _outside_copy(tmp_path: Path, folder: Path, name: str) -> Path:
    """Move ``name`` out of ``folder`` (into tmp_path/outside) and link it back in."""
    (tmp_path / "outside").mkdir(exist_ok=True)
    target = tmp_path / "outside" / name
    os.replace(folder / name, target)
    os.symlink(target, folder / name)
    return folder / name


def index_linked_out(tmp_path):
    """The issue's case: an index that is a link to weights elsewhere (a complete, valid
    index and shards there) was followed and loaded."""
    folder = _hf(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    write_hf(str(elsewhere), source_tensors(seed=12), shards=2)
    (folder / "model.safetensors.index.json").unlink()
    os.symlink(elsewhere / "model.safetensors.index.json", folder / "model.safetensors.index.json")
    return folder, f"{folder / 'model.safetensors.index.json'} {LINKED}"


def index_named_directly_linked_out(tmp_path):
    folder = _hf(tmp_path)
    path = _outside_copy(tmp_path, folder, "model.safetensors.index.json")
    return path, f"{path} {LINKED}"


def shard_linked_out(tmp_path):
    folder = _hf(tmp_path)
    path = _outside_copy(tmp_path, folder, "model-00002-of-00002.safetensors")
    return folder, f"{path} {LINKED}"


def single_file_linked_out(tmp_path):
    folder = tmp_path / "one"
    write_hf(str(folder), source_tensors(), shards=1)
    path = _outside_copy(tmp_path, folder, "model.safetensors")
    return folder, f"{path} {LINKED}"


def index_is_a_fifo(tmp_path):
    folder = _hf(tmp_path)
    (folder / "model.safetensors.index.json").unlink()
    os.mkfifo(folder / "model.safetensors.index.json")  # reading it would block forever
    return folder, (f"{folder / 'model.safetensors.index.json'} is not a regular file "
                    "(refusing to read it)")


@pytest.mark.parametrize("damage", [nothing_there, empty_folder, index_not_json,
                                    index_without_weight_map, shard_missing,
                                    key_not_in_its_shard, shard_escapes, shard_truncated,
                                    a_distrun_checkpoint, shapes_differ, index_linked_out,
                                    index_named_directly_linked_out, shard_linked_out,
                                    single_file_linked_out, index_is_a_fifo])
def test_bad_weights_are_one_line_and_change_nothing(tmp_path, damage):
    path, expected = damage(tmp_path)
    model = _fresh()
    kept = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UsageError) as info:
        load_weights(str(path), model)
    assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert _equal(model, kept) == []


def test_prefix_spellings():
    from distrun_safetensors.weights import parse_prefix

    assert parse_prefix("model.") == ("model.", "")
    assert parse_prefix("=model.") == ("", "model.")
    assert parse_prefix("transformer.=model.") == ("transformer.", "model.")
    with pytest.raises(UsageError, match="give OLD=NEW"):
        parse_prefix("a=b=c")


def test_trainer_loads_them_at_fit_start_and_a_resume_wins(tmp_path, caplog):
    import st_plugin
    from st_best import Probe
    from st_task import Task

    from distrun import Trainer

    src = {k: torch.randn(v.shape) for k, v in Task().configure_model().state_dict().items()}
    write_hf(str(tmp_path / "hf"), src)
    common = dict(strategy="single", batch_size=8, max_steps=2, summary=False,
                  run_dir=str(tmp_path / "run"), init_weights=str(tmp_path / "hf"))
    probe = Probe()
    with caplog.at_level(logging.INFO, logger="distrun"):
        Trainer(plugins=(st_plugin, probe), ckpt_save_on_end=True, **common).fit(Task())
    assert all(torch.equal(v, src[k]) for k, v in probe.start.items())
    assert any(f"Initial weights from {tmp_path / 'hf'}: 4 tensors from 2 file(s)"
               in r.getMessage() for r in caplog.records)
    assert find_weights(str(tmp_path / "hf")).files  # still there, untouched
    # resuming: the checkpoint wins, and the log says so
    caplog.clear()
    resumed = Probe()
    with caplog.at_level(logging.INFO, logger="distrun"):
        run = Trainer(plugins=(st_plugin, resumed), resume="latest",
                      **{**common, "max_steps": 3}).fit(Task())
    assert any("is not loaded: the run resumed from" in r.getMessage()
               and "(the checkpoint wins)" in r.getMessage() for r in caplog.records)
    assert not any("Initial weights" in r.getMessage() for r in caplog.records)
    assert run.resumed_from.endswith("step-2")
    assert not all(torch.equal(v, src[k]) for k, v in resumed.start.items())


@pytest.mark.slow
def test_every_layout_on_two_ranks_reads_only_its_part(tmp_path):
    """DDP's layout (a replica per rank), FSDP2 and TP on 2 gloo ranks: the reassembled
    tensors equal the source bit for bit; a sharded rank reads about half the bytes."""
    src = source_tensors()
    write_hf(str(tmp_path / "hf"), src, shards=2)
    results = run_on_ranks(rank_load_layouts, 2, str(tmp_path / "hf"), init_process_group=True,
                           timeout=240)
    total = sum(t.numel() * t.element_size() for t in src.values())
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for rank, out in enumerate(results):
        for layout, got in out.items():
            bad = [k for k in src if not torch.equal(got["tensors"][k], src[k])]
            assert bad == [] and set(got["tensors"]) == set(src), (rank, layout, bad)
            assert got["max_open"] == 1 and got["opened"] == shards, (rank, layout)
        assert out["plain"]["bytes_read"] == total
        # fsdp: every tensor sharded by rows; tp: fc1 by rows, fc2 by columns, the rest whole
        assert out["fsdp"]["bytes_read"] < 0.7 * total, out["fsdp"]["bytes_read"]
        assert out["tp"]["local"]["fc1.weight"] == 5 * 7 and out["tp"]["local"]["fc2.weight"] == 25
    # FSDP2 shards parameters, not buffers: both ranks read the buffer `scale` whole
    scale = src["scale"].numel() * src["scale"].element_size()
    assert sum(o["fsdp"]["bytes_read"] for o in results) == total + scale


def _strategies() -> set[str]:
    from distrun._registry.collect import collect_strategies
    from distrun._registry.manager import make_plugin_manager

    return set(collect_strategies(make_plugin_manager()))


def _env(**extra: str) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            "DISTRUN_PLUGINS": "st_plugin", "DISTRUN_TIMEOUT": "120", **extra}


@pytest.mark.slow
def test_distrun_run_init_weights_under_each_strategy_and_bad_input_exit_2(tmp_path):
    from safetensors.torch import load_file

    src = {f"model.{k}": torch.randn(v.shape)
           for k, v in __import__("st_task").Task().configure_model().state_dict().items()}
    write_hf(str(tmp_path / "hf"), src)
    want = {k.removeprefix("model."): v for k, v in src.items()}
    installed = _strategies()
    runs = {"single": ("1", "single"), "st_ddp": ("2", "st_ddp"), "st_fsdp": ("2", "st_fsdp")}
    runs.update({name: ("2", name) for name in ("ddp", "fsdp", "tp") if name in installed})
    for name, (nproc, strategy) in runs.items():
        dump = tmp_path / f"start-{name}.safetensors"
        result = run_cli("run", "--nproc-per-node", nproc, "--strategy", strategy,
                         "--batch-size", "8", "--max-steps", "1", "--run-dir",
                         str(tmp_path / name), "--init-weights", str(tmp_path / "hf"),
                         "--init-weights-prefix", "model.", TASK,
                         env=_env(ST_DUMP_START=str(dump)), timeout=300)
        assert result.returncode == 0, (name, result)
        got = load_file(str(dump))
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), name
        assert "Initial weights from" in result.output
    # the names do not fit (no prefix given): exit 2, one line, the fix named, on 2 ranks
    bad = run_cli("run", "--nproc-per-node", "2", "--strategy", "st_ddp", "--max-steps", "1",
                  "--run-dir", str(tmp_path / "bad"), "--init-weights", str(tmp_path / "hf"),
                  TASK, env=_env(), timeout=300)
    assert bad.returncode == 2, bad
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--init-weights-prefix model. renames them" in errors[0], bad
    assert "Traceback" not in bad.output
    missing = run_cli("run", "--max-steps", "1", "--run-dir", str(tmp_path / "bad2"),
                      "--init-weights", str(tmp_path / "nope"), TASK, env=_env(), timeout=300)
    assert missing.returncode == 2 and "no such file or folder" in missing.stderr, missing
    # issue 26: an index linked to a folder elsewhere is refused, not followed
    linked = tmp_path / "linked"
    linked.mkdir()
    os.symlink(tmp_path / "hf" / "model.safetensors.index.json",
               linked / "model.safetensors.index.json")
    refused = run_cli("run", "--max-steps", "1", "--run-dir", str(tmp_path / "bad3"),
                      "--init-weights", str(linked), "--init-weights-prefix", "model.", TASK,
                      env=_env(), timeout=300)
    assert refused.returncode == 2, refused
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --init-weights {linked}: {linked / 'model.safetensors.index.json'}"
                      " is a link that leaves the weights folder (refusing to read it)"], refused
    assert "Traceback" not in refused.output


@pytest.mark.slow
def test_round_trip_with_transformers(tmp_path):
    """Optional (needs `transformers`; nothing is downloaded): a tiny GPT-2 written by
    save_pretrained in shards loads bit-equal (its tied lm_head included); a distrun
    checkpoint of it, consolidated, loads back with from_pretrained."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=16)
    torch.manual_seed(0)
    original = transformers.GPT2LMHeadModel(config)
    original.save_pretrained(str(tmp_path / "hf"), max_shard_size="20KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and "lm_head.weight" not in \
        index["weight_map"]
    torch.manual_seed(1)
    fresh = transformers.GPT2LMHeadModel(config)
    result = load_weights(str(tmp_path / "hf"), fresh)
    assert result.max_open == 1 and "lm_head.weight = transformer.wte.weight" in result.tied
    want = original.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in fresh.state_dict().items())

    from distrun_safetensors.consolidate import consolidate
    from distrun_safetensors.save import Checkpointer

    path = Checkpointer(str(tmp_path / "ckpt")).save(1, fresh)
    consolidate(path, str(tmp_path / "out"), max_shard_bytes=20_000)
    config.save_pretrained(str(tmp_path / "out"))
    back = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "out"))
    assert all(torch.equal(v, want[k]) for k, v in back.state_dict().items())
