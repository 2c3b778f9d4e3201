"""Triton rotate_qk against the torch reference of RotaryEmbedding (rotate / norm_rotate)."""
import pytest
import torch

from nanovllm.kernels.rotary import rotate_qk
from nanovllm.layers.rotary_embedding import RotaryEmbedding, norm_rotate, rotate

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _qkv(num_tokens, q_heads, kv_heads, head_dim, dtype):
    """q and k as strided views of one fused projection output, as the model passes them."""
    qkv = torch.randn(num_tokens, (q_heads + 2 * kv_heads) * head_dim, device=DEVICE).to(dtype)
    q = qkv[:, :q_heads * head_dim].view(num_tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim:(q_heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    return q, k


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(4, 2, 64), (2, 1, 128), (3, 3, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_torch_reference(norm, q_heads, kv_heads, head_dim, dtype):
    torch.manual_seed(0)
    num_tokens = 7
    rope = RotaryEmbedding(head_dim, 512, 10000.0).to(DEVICE)
    positions = torch.tensor([0, 1, 5, 17, 100, 311, 511], device=DEVICE)
    q, k = _qkv(num_tokens, q_heads, kv_heads, head_dim, dtype)
    assert not q.is_contiguous() and not k.is_contiguous()
    if norm:
        q_w = (1 + 0.1 * torch.randn(head_dim, device=DEVICE)).to(dtype)
        k_w = (1 + 0.1 * torch.randn(head_dim, device=DEVICE)).to(dtype)
        expected = norm_rotate(positions, q, k, rope.cos_sin_cache, q_w, k_w, 1e-6)
        got = rotate_qk(positions, q, k, rope.cos_sin_cache, q_w, k_w, 1e-6)
    else:
        expected = rotate(positions, q, k, rope.cos_sin_cache)
        got = rotate_qk(positions, q, k, rope.cos_sin_cache)
    # float32: the same arithmetic; bfloat16: one rounding step apart at most (the interpreter truncates
    # where CUDA rounds, and fused multiply-adds differ)
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    for e, g in zip(expected, got):
        assert g.shape == e.shape and g.dtype == dtype and g.is_contiguous()
        torch.testing.assert_close(g.float(), e.float(), atol=atol, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_position_zero_is_the_identity_and_rotation_keeps_norms():
    rope = RotaryEmbedding(64, 64, 10000.0).to(DEVICE)
    q, k = _qkv(3, 2, 1, 64, torch.float32)
    q_rot, k_rot = rotate_qk(torch.tensor([0, 9, 63], device=DEVICE), q, k, rope.cos_sin_cache)
    torch.testing.assert_close(q_rot[0], q[0])
    torch.testing.assert_close(k_rot[0], k[0])
    # each (i, i + 32) pair is rotated in its plane: pairwise lengths are kept
    pair_len = lambda x: x[..., :32] ** 2 + x[..., 32:] ** 2
    torch.testing.assert_close(pair_len(q_rot), pair_len(q), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(q_rot[1], q[1])
