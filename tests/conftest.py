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


def _speed_up_the_interpreter() -> None:
    """Two shortcuts in Triton's interpreter (3.x), which runs every kernel test on the CPU; only its
    speed changes: the same functions run on the same values.

    First, it swaps triton.language's builtins for interpreted ones when a kernel
    launches, and undoes that when it ends; but it repeats the swap on every call of a @triton.jit helper
    inside the kernel (tl.rand4x's Philox, our _gumbel, ...), a scan of the modules' members that is a
    no-op once they are swapped and took a third of the sampling kernels' interpreted time. Here a helper's
    call skips it when the launch in progress has swapped every module the helper sees; anything else
    (a helper that sees a module the kernel did not) takes the interpreter's own path. Second, below:
    xor reductions in numpy."""
    try:
        import numpy as np
        from triton.runtime import interpreter
        original, executor_call = interpreter._patch_lang, interpreter.GridExecutor.__call__
        language, core = interpreter.tl, interpreter.tl.core
        interpreter.ReduceOps.apply_impl, interpreter._LangPatchScope    # noqa: B018 (both must exist)
    except (ImportError, AttributeError):       # another interpreter layout: leave it as it is
        return
    swapped: list[set] = []                     # per launch in progress, the modules it swapped

    def langs_of(fn) -> set:
        return {id(value) for value in fn.__globals__.values() if value is language or value is core}

    def patch_lang(fn):
        langs = langs_of(fn)
        if swapped and langs and langs <= swapped[-1]:
            return interpreter._LangPatchScope()    # nothing to swap, nothing to undo
        scope = original(fn)
        if swapped:
            swapped[-1] |= langs
        return scope

    def call(self, *args, **kwargs):
        swapped.append(set())
        try:
            return executor_call(self, *args, **kwargs)
        finally:
            swapped.pop()

    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = call

    # tl.sort's bitonic network reduces with xor_sum, for which the interpreter has no numpy path: it
    # called the combine function once per element (nine tenths of a sampling kernel's time). An xor
    # over an axis of integers is exact in any order, so numpy's reduction gives the same bits.
    xor_combine = getattr(interpreter.tl.standard, "_xor_combine", None)
    reduce_impl = interpreter.ReduceOps.apply_impl

    def apply_impl(self, input):
        if xor_combine is not None and self.combine_fn is xor_combine and len(input) == 1:
            data = input[0].handle.data
            return self.to_tensor(np.bitwise_xor.reduce(data, axis=self.axis, keepdims=self.keep_dims), input[0].dtype)
        return reduce_impl(self, input)

    interpreter.ReduceOps.apply_impl = apply_impl


if os.environ.get("TRITON_INTERPRET") == "1":
    _speed_up_the_interpreter()


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
