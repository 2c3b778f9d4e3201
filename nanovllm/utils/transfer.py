"""Host-to-device copies that never make the host wait."""
import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Through pinned memory, queued on the stream: a copy from pageable memory would make the host
    wait for the device, and the step pipeline would stall."""
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor
