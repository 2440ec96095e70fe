"""Where every rank is, and who a stuck or slow run waits for.

``position``: each rank's record of its step, phase and collective (written by the rank, read
by its launcher); ``collectives``: the marks of torch.distributed's collectives; ``stacks``:
every thread's stack of a rank on request; ``summary``: the one line that names the odd rank;
``watcher``: the launcher's stall watcher, a node service of every worker group.
"""
