"""Host-to-device copies: several small arrays in one copy come back as they went, each starting at a
16-byte boundary (Triton specializes its kernels on a pointer's alignment: a packed view must look like a
tensor of its own)."""
import numpy as np
import pytest
import torch

from nanovllm.utils.transfer import arrays_to_device

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_arrays_travel_together_and_come_back_as_they_went(device):
    arrays = [np.arange(12, dtype=np.float32).reshape(3, 4) / 7, np.array([2**62 - 1, -5, 3], dtype=np.int64),
              np.array([[7, -1, 0]], dtype=np.int32), np.array([], dtype=np.int64), np.array([9], dtype=np.int64)]
    tensors = arrays_to_device(arrays, torch.device(device))
    for array, tensor in zip(arrays, tensors):
        assert tensor.device.type == device and tensor.dtype == torch.from_numpy(array).dtype
        assert tensor.shape == array.shape and torch.equal(tensor.cpu(), torch.from_numpy(array))
        assert tensor.data_ptr() % 16 == 0
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1      # one buffer: one copy
