"""The safetensors plugin's options, read typed with ``CheckpointOptions.of(config)`` (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from distrun.plugin import PluginOptions, option


@dataclass(frozen=True)
class CheckpointOptions(PluginOptions, plugin="safetensors"):
    """The safetensors plugin's options (``CheckpointOptions.of(config)``)."""

    ckpt_dir: str = option("", "checkpoint folder (default: RUN_DIR/checkpoints)", exclusive=True)
    ckpt_every_n_steps: int = option(
        0, "save a checkpoint every N optimizer steps (0: off)",
        min=0)
    ckpt_every_n_seconds: float = option(
        0.0, "save when this many seconds passed since the last save (0: off)",
        min=0)
    ckpt_keep_last: int = option(3, "keep the N newest checkpoints (0: keep all)", min=0)
    ckpt_save_on_end: bool = option(
        True, "save a checkpoint of the last step when training ends, in RUN_DIR/checkpoints "
        "(--no-ckpt-save-on-end: none)")
    ckpt_async: bool = option(
        False, "copy tensors to CPU memory and write them in a background thread")
    ckpt_memory_every_n_steps: int = option(
        0, "also keep a checkpoint in this node's memory every N steps, written in the "
        "background: a restart on the node loads the newest from memory, not the disk (0: off)",
        min=0)
    ckpt_memory_max_gb: float = option(
        0.0, "at most this much memory for --ckpt-memory-every-n-steps (0: what /dev/shm and "
        "the free memory allow); a state that does not fit turns the memory tier off at its "
        "first save", min=0)
    ckpt_memory_replica_mb_s: float = option(
        1000.0, "a state sharded across nodes: each node's part of a memory checkpoint is "
        "also copied into the next node's memory, at most this many MB/s each way (0: no "
        "limit)", min=0)
    ckpt_verify: bool = option(True, "verify checksums when loading (--no-ckpt-verify skips it)")
    ckpt_split_mb: float = option(
        4.0, "replicated tensors larger than this are split by rows across ranks when saved",
        min=0)
    ckpt_monitor: str = option(
        "", "keep the checkpoints with the best values of this logged metric (e.g. val_loss)")
    ckpt_mode: str = option(
        "min", "whether a smaller or a larger --ckpt-monitor value is better",
        choices=("min", "max"))
    ckpt_save_top_k: int = option(1, "how many best checkpoints --ckpt-monitor keeps", min=1)
    ckpt_resume_best: bool = option(
        False, "--resume latest|auto|FOLDER loads the checkpoint `best` names instead of `latest`")
    init_weights: str = option(
        "", "start from these weights: a folder with model.safetensors.index.json and its shards "
        "(Hugging Face layout) or a .safetensors file; ignored when the run resumes")
    init_weights_prefix: str = option(
        "", "rename the file's tensors: OLD=NEW replaces the prefix OLD by NEW (`model.` alone "
        "strips it, `=model.` adds it)")
    init_weights_strict: bool = option(
        True, "every model tensor must be in --init-weights with its shape, and nothing else "
        "(--no-init-weights-strict loads the ones that match and logs the rest)")
