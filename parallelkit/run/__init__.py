"""Running training: the loop and its callbacks, checkpoints, prefetching, and processes on several hosts."""
