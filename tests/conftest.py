"""Test-wide setup: Triton through its interpreter when there is no GPU, random checkpoints, and the
parallel run (pytest-xdist): torch threads per worker, and which tests may share the GPU."""
import os

# Tests' CPU work is small tensors and tiny engines. On a many-core GPU box torch would take a thread per
# core and spin them against each other: a CPU-engine test took 72 s with 16 threads on the H100 machine,
# 22 s with 4 and 19 s with 1. Set before torch is imported, so spawned engine and worker processes
# inherit it too; a machine of two cores (CI) keeps its default.
CORES = len(os.sched_getaffinity(0))
os.environ.setdefault("OMP_NUM_THREADS", str(min(2, CORES)))
# Under pytest-xdist (`-n auto`) the workers share the cores: each takes its share of them (at most the 2
# above), and so do the processes its tests start (engines, tensor-parallel workers, servers), which inherit
# OMP_NUM_THREADS. Two workers on two cores with two threads each made decode 20x slower (one_torch_thread).
# The variable is lowered, not set: the controller process already set it above for the whole machine, and
# a smaller value given by the user stands.
XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) if "PYTEST_XDIST_WORKER" in os.environ else 0
if XDIST_WORKERS:
    os.environ["OMP_NUM_THREADS"] = str(min(int(os.environ["OMP_NUM_THREADS"]), max(1, CORES // XDIST_WORKERS)))

import pytest  # noqa: E402
import torch  # noqa: E402

if XDIST_WORKERS:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))    # in case torch was imported before this file

CUDA = torch.cuda.is_available()
# pytest-xdist's workers collect the tests each on its own, and the ids they collect must agree. A worker that
# could not reach the GPU the controller saw (it happened once on the H100 box, with another process starting
# CUDA beside the workers) would collect other ids and run the GPU tests through the interpreter: say so
# instead of xdist's bare "Different tests were collected".
if not XDIST_WORKERS:
    os.environ["NANOVLLM_TESTS_CUDA"] = str(int(CUDA))     # the controller's view, which its workers inherit
elif os.environ.get("NANOVLLM_TESTS_CUDA", str(int(CUDA))) != str(int(CUDA)):
    raise pytest.UsageError(f"xdist worker {os.environ['PYTEST_XDIST_WORKER']} sees CUDA: {CUDA}, pytest's "
                            f"controller saw {not CUDA}; rerun with the GPU free of other processes")

if not CUDA:
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


@pytest.hookimpl(tryfirst=True)     # before xdist's own hook, which turns the groups into node ids
def pytest_collection_modifyitems(config, items):
    """xdist groups (honoured with `--dist loadgroup`, pyproject's addopts; without -n they change nothing).

    With CUDA, every test not marked cpu_only joins the group "cuda": one worker runs them all, one after
    another, since an engine takes 90% of the GPU's memory and two at once would fail. cpu_only tests (each
    pins device="cpu" throughout) spread over the other workers. Without CUDA nothing needs the GPU: every
    test may run anywhere.

    Tests that share a module- or class-scoped fixture (a server, an engine, a reference model) are kept on
    one worker, so that it is set up once, not once per worker their tests land on."""
    for item in items:
        if item.get_closest_marker("xdist_group"):     # xdist would join two groups' names into a third
            raise pytest.UsageError(f"{item.nodeid}: xdist groups are given in tests/conftest.py only")
        fixtures = getattr(item, "_fixtureinfo", None)
        if CUDA and item.get_closest_marker("cpu_only") is None:
            item.add_marker(pytest.mark.xdist_group("cuda"))
        elif fixtures and any(defs[-1].scope in ("class", "module", "package")
                              for defs in fixtures.name2fixturedefs.values()):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


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


# A model whose CPU decode steps (the servers', AsyncLLM's) take tens of milliseconds, not the tiny one's tens of microseconds: a
# request of a few hundred tokens is still running when a test acts on it (the tiny model is done with 480
# tokens in ~80 ms). Its size, not Triton's interpreter (an earlier way to slow steps), so that it holds with
# any Triton: the GPU machine's Triton 3.6 interpreter cannot run the attention kernels.
SLOW_MODEL_SHAPE = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=12,
                        num_key_value_heads=4, head_dim=64)


@pytest.fixture(scope="session")
def slow_model(make_checkpoint):
    return make_checkpoint(**SLOW_MODEL_SHAPE)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Two threads on two busy cores spin against each other (20x slower decode seen); one is plenty.
    Modules that run many engine steps use it: pytestmark = pytest.mark.usefixtures("one_torch_thread")."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
