"""distrun-pipeline: pipeline parallelism (``pp``, ``pp+ddp``, ``pp+fsdp``) on torch.distributed.pipelining."""

__all__: list[str] = []
