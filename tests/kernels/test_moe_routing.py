"""The router's top-k kernel (nanovllm.kernels.moe_routing) against the torch route in nanovllm.layers.fused_moe:
the same experts and weights, ties to the lowest id, on CPU through Triton's interpreter and on a GPU."""
import pytest
import torch

from nanovllm.kernels import moe_routing as kernels
from nanovllm.layers import fused_moe as oracle

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("num_experts,top_k", [(8, 1), (8, 2), (8, 8), (16, 8), (60, 4), (64, 8)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_torch(num_experts, top_k, renormalize):
    logits = torch.randn(7, num_experts, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(num_experts))
    weights, ids = kernels.route(logits, top_k, renormalize)
    ref_weights, ref_ids = oracle.route(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), ref_ids)         # float32 logits: no ties
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-7)
    if renormalize:
        torch.testing.assert_close(weights.sum(1), torch.ones(7, device=DEVICE))


def test_route_16_bit_logits_and_ties():
    """bf16 logits tie often: any of the tied experts is right, and the weights are the same; exact ties
    go to the lowest ids (torch.topk's order among ties is unspecified)."""
    torch.manual_seed(0)
    logits = (2 * torch.randn(33, 60, device=DEVICE)).to(torch.bfloat16)
    weights, ids = kernels.route(logits, 8, False)
    ref_weights, _ = oracle.route(logits, 8, False)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-7)
    probs = torch.softmax(logits.float(), -1)
    torch.testing.assert_close(probs.gather(1, ids.long()), weights, rtol=1e-5, atol=1e-7)
    assert (ids.sort(1).values.diff(dim=1) > 0).all()                   # distinct experts

    flat = torch.zeros(2, 12, device=DEVICE)
    flat[1, [3, 7, 9]] = 1.0                                            # three tied leaders, then nine ties
    weights, ids = kernels.route(flat, 5, True)
    assert ids.tolist() == [[0, 1, 2, 3, 4], [3, 7, 9, 0, 1]]
    torch.testing.assert_close(weights[0], torch.full((5,), 0.2, device=DEVICE))


def test_route_empty():
    weights, ids = kernels.route(torch.empty(0, 8, device=DEVICE), 2, True)
    assert weights.shape == ids.shape == (0, 2)
