"""`python -m nanovllm.serve MODEL ...`, the same as `nanovllm serve MODEL ...` (nanovllm/entrypoints/serve_command.py)."""
from nanovllm.entrypoints.serve_command import main

if __name__ == "__main__":
    main(prog="python -m nanovllm.serve")
