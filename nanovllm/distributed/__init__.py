"""The tensor-parallel machinery, below the layers and above the kernels: group (who this process is in
its group, and the collectives the layers call), peer_memory (the one-shot all-reduce's IPC buffers),
workers (the worker processes of ranks 1..N-1: start, watch, call, stop; what each runs is handed in, so
nothing here imports the engine), shm_channel (rank 0's calls to them over shared memory) and
stderr_tap (their stderr, forwarded and remembered)."""
