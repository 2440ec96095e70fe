"""A TorchX component that runs ``distrun run`` (``torchx run -s SCHEDULER distrun.run ...``)."""
