"""The penalty state that lives on the device across steps (rank 0): per sequence with repetition,
frequency or presence penalties, a row of which tokens its prompt holds and how often each token occurs
in its output. The penalty kernels read the rows in place (layers/sampler.py, kernels/penalties.py)."""
import numpy as np
import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.kernels import penalties as penalty_kernels
from nanovllm.utils.transfer import to_device


class PenaltyState:
    """Per sequence with penalties, on the device: which tokens its prompt holds and how often each
    token occurs in its output. The counts grow from the sampled tokens on the device (never rebuilt on
    the host); rows are freed when the engine says the sequence ended."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.rows: dict[int, int] = {}
        self.free: list[int] = []
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)

    def _grow(self) -> None:
        old = self.prompt_mask.size(0)
        new = max(8, 2 * old)
        self.prompt_mask = torch.cat([self.prompt_mask, self.prompt_mask.new_zeros(new - old, self.vocab_size)])
        self.output_counts = torch.cat([self.output_counts, self.output_counts.new_zeros(new - old, self.vocab_size)])
        self.free.extend(range(new - 1, old - 1, -1))

    def rows_for(self, seqs: list[Sequence]) -> torch.Tensor:
        """State rows for these sequences; a new one starts from its prompt (and any known output)."""
        rows = []
        for seq in seqs:
            row = self.rows.get(seq.seq_id)
            if row is None:
                if not self.free:
                    self._grow()
                row = self.rows[seq.seq_id] = self.free.pop()
                prompt = to_device(np.array(seq.prompt_token_ids, dtype=np.int64), self.device)
                self.prompt_mask[row] = False
                self.prompt_mask[row, prompt] = True
                output = [t for t in seq.completion_token_ids if t >= 0]
                counts = np.bincount(np.array(output, dtype=np.int64), minlength=self.vocab_size).astype(np.int32)
                self.output_counts[row] = to_device(counts, self.device)
            rows.append(row)
        return to_device(np.array(rows, dtype=np.int64), self.device)

    def count(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """output_counts[rows[i], token_ids[i]] += 1: one small kernel on a GPU (Sampler.warmup compiles it)."""
        if self.output_counts.is_cuda:
            penalty_kernels.count_tokens(self.output_counts, rows, token_ids)
        else:
            self.output_counts.index_put_((rows, token_ids), torch.ones_like(token_ids, dtype=torch.int32),
                                          accumulate=True)

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            row = self.rows.pop(seq_id, None)
            if row is not None:
                self.free.append(row)
