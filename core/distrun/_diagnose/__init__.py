"""Where every rank is, and who a stuck or slow run waits for.

``position``: each rank's record of its step, phase and collective (written by the rank, read
by its launcher); ``torch_calls``: the marks of torch.distributed's collectives (and a plain
script's steps); ``stacks``: every thread's stack of a rank on request; ``summary``: the one
line that names the odd rank; ``watcher``: the launcher's stall watcher, a node service of
every worker group; ``exchange``: the nodes' reports shared through the run's store;
``straggler``: the slow rank, from the ranks' compute times.
"""
