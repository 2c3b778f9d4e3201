"""Test-wide setup: Triton through its interpreter when there is no GPU, and random checkpoints."""
import os

# Tests' CPU work is small tensors and tiny engines. On a many-core GPU box torch would take a thread per
# core and spin them against each other: a CPU-engine test took 72 s with 16 threads on the H100 machine,
# 22 s with 4 and 19 s with 1. Set before torch is imported, so spawned engine and worker processes
# inherit it too; a machine of two cores (CI) keeps its default.
os.environ.setdefault("OMP_NUM_THREADS", str(min(2, len(os.sched_getaffinity(0)))))

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # must be set before triton is first imported, so that @triton.jit kernels run on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory):
    """make_checkpoint(**shape) -> directory of a random-weight checkpoint, written once per shape."""
    from benchmarks.random_checkpoint import write_random_checkpoint
    written = {}

    def make(**shape):
        key = tuple(sorted((k, repr(v)) for k, v in shape.items()))
        if key not in written:
            written[key] = write_random_checkpoint(tmp_path_factory.mktemp("checkpoint"), **shape)
        return written[key]
    return make


@pytest.fixture(scope="session")
def tiny_model(make_checkpoint):
    """The default tiny Qwen3: 2 layers, hidden 64, 4 q / 2 kv heads, vocab 512."""
    return make_checkpoint()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Two threads on two busy cores spin against each other (20x slower decode seen); one is plenty.
    Modules that run many engine steps use it: pytestmark = pytest.mark.usefixtures("one_torch_thread")."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
