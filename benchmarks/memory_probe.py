"""Diagnostic: device memory seen by two engines built one after the other in one process."""
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench  # noqa: E402
from nanovllm import LLM  # noqa: E402

model = bench.default_model("cuda")
for i in range(3):
    free0, _ = torch.cuda.mem_get_info()
    llm = LLM(str(model), max_model_len=1024, gpu_memory_utilization=0.8, enforce_eager=True)
    blocks = llm.model_runner.num_kvcache_blocks
    llm.exit()
    del llm
    gc.collect()
    free1, _ = torch.cuda.mem_get_info()
    print(f"engine {i}: blocks {blocks}, free before {free0 / 2**30:.2f} GiB, after exit {free1 / 2**30:.2f} GiB, "
          f"allocated {torch.cuda.memory_allocated() / 2**20:.1f} MiB, reserved {torch.cuda.memory_reserved() / 2**20:.1f} MiB")
