"""nanovllm.kernels.launch: a kernel whose pipeline stages need more shared memory than the GPU has is launched
again with fewer stages (the tiles are tuned on Hopper; A100s and Ada cards have less), and what fitted is
remembered. On CPU with a stand-in kernel that refuses stages as Triton does; on a GPU with the MoE kernels at
tiles no GPU fits in eight stages, against the torch oracle."""
import pytest
import torch
from triton.runtime.errors import OutOfResources

from nanovllm.kernels import launch as launch_module
from nanovllm.kernels.launch import launch


class StandIn:
    """kernel[grid](*args, **options) as Triton's: refuses variants of more than `fits` stages, records tries."""

    def __init__(self, fits: int):
        self.fits, self.tries = fits, []

    def __getitem__(self, grid):
        def run(*args, num_stages=3, **options):
            self.tries.append((grid, args, num_stages, options))
            if num_stages > self.fits:
                raise OutOfResources(num_stages * 64 * 1024, self.fits * 64 * 1024, "shared memory")
        return run


@pytest.fixture(autouse=True)
def nothing_fitted_yet(monkeypatch):
    monkeypatch.setattr(launch_module, "_fitted_stages", {})


def test_a_kernel_that_fits_is_launched_once_as_asked():
    kernel = StandIn(fits=4)
    launch(kernel, (8, 2), "a", 1, BLOCK_N=64, num_warps=4, num_stages=4)
    assert kernel.tries == [((8, 2), ("a", 1), 4, dict(BLOCK_N=64, num_warps=4))]
    assert launch_module._fitted_stages == {}


def test_fewer_stages_until_it_fits_then_remembered():
    kernel = StandIn(fits=2)
    launch(kernel, (8,), "a", BLOCK_N=64, num_stages=4)
    assert [stages for _, _, stages, _ in kernel.tries] == [4, 3, 2]
    kernel.tries.clear()
    launch(kernel, (16,), "b", BLOCK_N=64, num_stages=4)          # the same variant, another grid and args
    assert kernel.tries == [((16,), ("b",), 2, dict(BLOCK_N=64))]
    kernel.tries.clear()
    launch(kernel, (8,), "a", BLOCK_N=32, num_stages=3)           # other tiles: tried afresh
    assert [stages for _, _, stages, _ in kernel.tries] == [3, 2]


def test_a_kernel_that_never_fits_raises_the_first_refusal():
    kernel = StandIn(fits=0)
    with pytest.raises(OutOfResources, match="shared memory") as refused:
        launch(kernel, (1,), num_stages=3)
    assert [stages for _, _, stages, _ in kernel.tries] == [3, 2, 1]
    assert f"{3 * 64 * 1024}" in str(refused.value)                 # what the tuned variant needed
    assert launch_module._fitted_stages == {}


def test_other_errors_pass_through_untouched():
    class Broken:
        def __getitem__(self, grid):
            def run(*args, **options):
                raise ValueError("a bad argument")
            return run
    with pytest.raises(ValueError, match="a bad argument"):
        launch(Broken(), (1,), num_stages=4)


def test_prefill_attention_takes_small_tiles_where_shared_memory_is_small(monkeypatch):
    """On a 99 KiB GPU (Ada) prefill attention's tiles are 64 x 64 in two stages; Hopper keeps its tuned ones."""
    from nanovllm.kernels import prefill_attention
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(prefill_attention, "shared_memory", lambda device: 99 * 1024)
    small = prefill_attention._default_config(128, torch.bfloat16, cuda, keys=8192)
    assert (small["block_m"], small["block_n"], small["num_stages"]) == (64, 64, 2)
    monkeypatch.setattr(prefill_attention, "shared_memory", lambda device: 227 * 1024)
    assert prefill_attention._default_config(128, torch.bfloat16, cuda, keys=8192)["block_m"] == 128


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_shared_memory_is_the_devices():
    from nanovllm.kernels.launch import shared_memory
    major, _ = torch.cuda.get_device_capability()
    assert shared_memory(torch.device("cuda")) >= (227 * 1024 if major == 9 else 99 * 1024)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_moe_tiles_too_big_for_eight_stages_still_run():
    """gate_up tiles of 64 rows and 128 columns (gate's and up's: ~40 KiB a stage) in eight stages exceed every
    GPU's shared memory (Hopper's 227 KiB included) and fit in two: the kernel runs in fewer stages, matches
    the oracle, and the next call goes straight to what fitted (the same bits)."""
    from nanovllm.kernels import fused_moe as kernels
    from nanovllm.kernels.fused_moe import MoeConfig, Tile
    from nanovllm.layers import fused_moe as oracle
    torch.manual_seed(0)
    num_experts, hidden, inter, top_k = 8, 1024, 256, 2           # 16 K steps: room for eight stages
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device="cuda") * 0.05).bfloat16()
    w2 = (torch.randn(num_experts, hidden, inter, device="cuda") * 0.05).bfloat16()
    x = torch.randn(300, hidden, device="cuda").bfloat16()
    weights, ids = oracle.route(torch.randn(300, num_experts, device="cuda"), top_k, True)
    deep = MoeConfig(64, Tile(128, 64, 4, 8), Tile(128, 64, 4, 8))
    out = kernels.fused_moe(x, w13, w2, weights, ids, deep)
    fitted = launch_module._fitted_stages
    assert fitted and all(1 <= stages < 8 for stages in fitted.values())
    ref = oracle.fused_moe(x, w13, w2, weights, ids.long())
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(kernels.fused_moe(x, w13, w2, weights, ids, deep), out)
    assert launch_module._fitted_stages == fitted
