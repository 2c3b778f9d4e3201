"""Diagnostic: device memory seen by engines built one after another in a process where another engine
(CUDA graphs, half the memory) stays resident and has sampled with every option, as tests/engine/test_gpu.py does."""
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402


def report(label: str) -> None:
    free, _ = torch.cuda.mem_get_info()
    print(f"{label}: free {free / 2**30:.2f} GiB, allocated {torch.cuda.memory_allocated() / 2**20:.1f} MiB, "
          f"reserved {torch.cuda.memory_reserved() / 2**20:.1f} MiB", flush=True)


model = str(bench.default_model("cuda"))
resident = LLM(model, max_model_len=1024, gpu_memory_utilization=0.5)
report("resident built")
resident.generate([[1, 2, 3] * 50] * 8, [SamplingParams(max_tokens=16, top_k=20, top_p=0.9, logprobs=3, n=2,
                                                         repetition_penalty=1.2, seed=1)] * 8, use_tqdm=False)
report("resident sampled")
for i in range(3):
    llm = LLM(model, max_model_len=1024, gpu_memory_utilization=0.8, enforce_eager=True)
    print(f"engine {i}: blocks {llm.model_runner.num_kvcache_blocks}")
    llm.exit()
    del llm
    gc.collect()
    report(f"engine {i} exited")
