"""The router's top-k on a GPU: one launch, a program per token takes the softmax over the experts in float32
and its top k by k rounds of argmax (ties go to the lowest expert id), optionally renormalized. The grouped
GEMMs that run the chosen experts: fused_moe.py."""
import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_row, TOP_K: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    real = experts < num_experts
    x = tl.load(logits_ptr + row * stride_row + experts, mask=real, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    probs = tl.where(real, p / tl.sum(p, 0), -1.0)        # pads below any probability, even 0
    slots = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, 0)
        idx = tl.min(tl.where(probs == best, experts, BLOCK_E), 0)     # ties: the lowest id
        top_w = tl.where(slots == j, best, top_w)
        top_i = tl.where(slots == j, idx, top_i)
        probs = tl.where(experts == idx, -2.0, probs)                  # taken
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, 0)
    tl.store(weights_ptr + row * TOP_K + slots, top_w, mask=slots < TOP_K)
    tl.store(ids_ptr + row * TOP_K + slots, top_i, mask=slots < TOP_K)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top_k experts by softmax probability (float32, largest first, ties to the lowest id)
    and their probabilities, renormalized to sum to one if asked: (weights float32 [T, k], ids int32 [T, k])."""
    num_tokens, num_experts = router_logits.shape
    assert 1 <= top_k <= num_experts
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    if num_tokens:
        block_e = triton.next_power_of_2(num_experts)
        _route_kernel[(num_tokens,)](router_logits, weights, ids, num_experts, router_logits.stride(0),
                                     TOP_K=top_k, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
                                     RENORMALIZE=renormalize, num_warps=1 if block_e <= 256 else 4)
    return weights, ids
