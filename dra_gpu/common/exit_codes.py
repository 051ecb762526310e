"""The `dra-gpu` command's exit statuses, one list for every subcommand (scripts and tests read them)."""

EXIT_OK = 0
EXIT_INVALID = 1  # the input was read and is invalid (validate), or a result cannot be built
EXIT_USAGE = 2  # bad arguments, unreadable files or cluster, nothing to do
# kubelet-plugin: its checkpoint is of a newer format (left unchanged), or a corrupt one's records
# could not be rebuilt (retried at the next start)
EXIT_STATE = 3
# kubelet-plugin: the node's driver was upgraded under it (libraries and kernel module of another
# version than the NVML it loaded, which a process cannot unload): restart it to serve the new one
EXIT_DRIVER_CHANGED = 4
# explain: a claim cannot be allocated (or its selectors simulated) with the devices given
EXIT_UNALLOCATABLE = 5
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as shells report it
