import itertools
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.kernels import penalties as penalty_kernels
from nanovllm.kernels import sampling as kernels
from nanovllm.kernels.token_bitmask import apply_token_bitmask, apply_token_bitmask_reference
from nanovllm.layers.logits_processor import (add_bias, apply_penalties, ban_tokens, keep_at_least, keep_only,
                                              thresholds_from_candidates)


@dataclass
class Penalties:
    """The penalized rows of a step and where their state lies (PenaltyState's tables, read in place:
    row rows[i] of the batch takes table row state_rows[i])."""
    rows: torch.Tensor              # [p] int64 rows of the batch
    state_rows: torch.Tensor        # [p] int64 rows of the tables
    prompt_mask: torch.Tensor       # [state rows, vocab] bool: the token is in the prompt
    output_counts: torch.Tensor     # [state rows, vocab] int32: the token's count in the output
    repetition: torch.Tensor        # [p] float32
    frequency: torch.Tensor
    presence: torch.Tensor


@dataclass
class SamplingTensors:
    """One step's sampling inputs, a row per sampled sequence, on the logits' device. The host-side
    summaries (max_logprobs, ...) choose the work without reading the device."""
    temperatures: torch.Tensor      # [rows] float32; 0 = greedy
    keys: torch.Tensor              # [rows] int64 Philox keys (a seed and position, or per-step random)
    top_k: torch.Tensor | None = None   # [rows] int32, 0 = off (filters are None when no row has any)
    top_p: torch.Tensor | None = None   # [rows] float32, 1 = off
    min_p: torch.Tensor | None = None   # [rows] float32, 0 = off
    filter_rows: torch.Tensor | None = None   # int32 rows with top_k or top_p (the exact search's grid)
    max_logprobs: int | None = None     # the most top log-probs a row asks for; None: no row asks
    penalties: Penalties | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None   # (rows, token ids) set to -inf
    # allowed_token_ids: (rows [a], their sets [a], set of each listed token [m], token ids [m]):
    # a row's tokens outside its set get -inf (logits_processor.keep_only)
    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None   # logit_bias: (rows, token ids, values)
    logits_rows: torch.Tensor | None = None     # the logits row of each sampled row (n > 1 repeats one)
    # structured outputs: (bitmask [r, words] int32, rows [r] int32): tokens whose bit is 0 get -inf
    token_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None
    # every row greedy, nothing edited or reported (sampling_inputs.argmax_suffices): a row's token is its
    # argmax, one launch instead of the sampler's kernels
    argmax_only: bool = False

    @property
    def edits(self) -> bool:
        """Whether anything edits the logits after the mask (and after the raw log-probs are read)."""
        return (self.allowed is not None or self.bias is not None or self.penalties is not None
                or self.banned is not None)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                     # [rows] int64
    logprobs: torch.Tensor | None = None        # [rows] the sampled token's log-prob (raw logits)
    top_token_ids: torch.Tensor | None = None   # [rows, max_logprobs] most likely first
    top_logprobs: torch.Tensor | None = None

    @classmethod
    def argmax(cls, logits: torch.Tensor) -> "SamplerOutput":
        """Every row greedy with nothing to edit or report (sampling_inputs.argmax_suffices): each row's token
        is its argmax (ties: the lowest id), one launch."""
        return cls(token_ids=logits.argmax(dim=-1))


class Sampler(nn.Module):
    """penalties -> temperature -> min_p -> top_k -> top_p -> draw, and log-probs of the raw logits.
    A structured output's mask comes first, before the log-probs too (as in vLLM: a token the grammar
    forbids has log-prob -inf).

    On a GPU nothing sorts the vocabulary and nothing waits for the host: the Triton kernels find each
    row's largest logits and softmax normalizers in two passes, the filters become one threshold a row,
    and a row whose kept tokens are all candidates (top_k, or a peaked top_p) draws among them; the exact
    bisection settles the rest, and one more pass over the vocabulary draws them. Log-probs' top k are
    exact there too: a flat row that overflows its candidates takes them from the row itself (ties:
    lowest id first). Elsewhere the same thresholds come from a full sort, and the draw is torch's.
    use_kernels=True takes the kernel path off the GPU too (Triton's interpreter, in tests)."""

    def __init__(self, use_kernels: bool | None = None):
        super().__init__()
        self.use_kernels = use_kernels

    def warmup(self, vocab_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """Compile every kernel variant for the model's logits dtype now (filters or not, log-probs or
        not, the exact search, log-probs of logits that allowed tokens, a bias, penalties or min_tokens edit,
        the penalties and the count of the penalized rows' tokens), so that the first request asking for one
        does not wait for Triton. The penalty state here has the engine's shapes and dtypes (PenaltyState's)."""
        logits = torch.randn(2, vocab_size, device=device).to(dtype)
        rows = torch.arange(2, dtype=torch.int32, device=device)
        state_rows = torch.tensor([1, 0], device=device)
        prompt_mask = torch.zeros(2, vocab_size, dtype=torch.bool, device=device)
        output_counts = torch.zeros(2, vocab_size, dtype=torch.int32, device=device)
        for filters, num_top, edits in itertools.product((False, True), (None, 1), (False, True)):
            if edits and num_top is None:
                continue            # edits alone take the same kernels as no edits
            t = SamplingTensors(temperatures=torch.tensor([1.0, 0.0], device=device),
                                keys=torch.arange(2, device=device), max_logprobs=num_top)
            if filters:     # top_k beyond the candidates: the exact search runs too
                t.top_k = torch.tensor([vocab_size, 0], dtype=torch.int32, device=device)
                t.top_p, t.min_p, t.filter_rows = torch.tensor([0.5, 1.0], device=device), torch.zeros(2, device=device), rows
            if edits:       # log-probs then come from the raw logits' candidates, apart from the draw
                t.banned = (rows.long(), torch.zeros(2, dtype=torch.int64, device=device))
                t.allowed = (rows[:1].long(), rows[:1].long(), torch.zeros(2, dtype=torch.int64, device=device),
                             rows.long())
                t.bias = (rows.long(), rows.long(), torch.full((2,), 0.5, device=device))
                t.penalties = Penalties(rows=rows.long(), state_rows=state_rows, prompt_mask=prompt_mask,
                                        output_counts=output_counts, repetition=torch.full((2,), 1.1, device=device),
                                        frequency=torch.full((2,), 0.5, device=device),
                                        presence=torch.full((2,), 0.5, device=device))
            if edits:       # and a structured output's mask
                t.token_bitmask = (torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32, device=device),
                                   rows[:1].clone())
            output = self(logits, t)
            if edits and self._on_kernels(logits):      # PenaltyState.count's kernel
                penalty_kernels.count_tokens(output_counts, state_rows, output.token_ids[t.penalties.rows])

    def _on_kernels(self, logits: torch.Tensor) -> bool:
        return logits.is_cuda if self.use_kernels is None else self.use_kernels

    def forward(self, logits: torch.Tensor, tensors: SamplingTensors) -> SamplerOutput:
        if tensors.logits_rows is not None:
            logits = logits[tensors.logits_rows]
        if tensors.argmax_only and tensors.token_bitmask is None:
            return SamplerOutput.argmax(logits)
        on_kernels = self._on_kernels(logits)
        self._mask(logits, tensors, on_kernels)
        raw = logits
        edits = tensors.edits
        num_top = tensors.max_logprobs
        if edits and num_top is not None:
            logits = logits.clone()     # the edits are in place; log-probs need the raw values
        # log-probs come from the raw logits: in the GPU's one pass when nothing edits them first
        fused = on_kernels and num_top is not None and not edits and num_top <= kernels.max_candidates(logits.size(1))
        output = SamplerOutput(token_ids=torch.empty(0))
        if num_top is not None and not fused:
            output.top_token_ids, output.top_logprobs, log_z = self._top_logprobs(raw, tensors.temperatures, num_top)
        self._edit(logits, tensors, on_kernels)
        if on_kernels:
            output.token_ids, _, top_ids, top_logprobs, fused_log_z = self._filter_and_draw(
                logits, tensors, num_top if fused else -1)
            if fused:
                output.top_token_ids, output.top_logprobs, log_z = top_ids, top_logprobs, fused_log_z
        else:
            thresholds = self._thresholds(logits, tensors) if tensors.top_k is not None else None
            output.token_ids = gumbel_max(logits, tensors.temperatures, thresholds, tensors.keys)
        if num_top is not None:
            output.logprobs = raw.gather(1, output.token_ids.unsqueeze(1)).squeeze(1).float() - log_z
        return output

    def with_logprobs(self, logits: torch.Tensor, tensors: SamplingTensors, token_ids: torch.Tensor) -> SamplerOutput:
        """token_ids (drawn elsewhere: speculative decoding's rejection sampler) with the log-probs forward()
        would give them: of the raw logits, the tokens' and each row's top tensors.max_logprobs."""
        output = SamplerOutput(token_ids=token_ids)
        if tensors.max_logprobs is None:
            return output
        if tensors.logits_rows is not None:
            logits = logits[tensors.logits_rows]
        if tensors.token_bitmask is not None:       # as forward()'s: of the masked logits
            logits = logits.clone()
            self._mask(logits, tensors, self._on_kernels(logits))
        output.top_token_ids, output.top_logprobs, log_z = self._top_logprobs(logits, tensors.temperatures,
                                                                              tensors.max_logprobs)
        output.logprobs = logits.gather(1, token_ids.unsqueeze(1)).squeeze(1).float() - log_z
        return output

    def _top_logprobs(self, raw: torch.Tensor, temperatures: torch.Tensor, num_top: int):
        """(top token ids, their log-probs, log_z) of the raw logits, num_top a row."""
        values, token_ids, _, _, log_z, _ = self._largest(raw, temperatures, max(num_top, 1))
        return token_ids[:, :num_top], values[:, :num_top] - log_z.unsqueeze(1), log_z

    @staticmethod
    def _mask(logits: torch.Tensor, tensors: SamplingTensors, on_kernels: bool) -> None:
        """Structured outputs' token masks, in place: -inf where a row's grammar forbids the token."""
        if tensors.token_bitmask is not None:
            mask = apply_token_bitmask if on_kernels else apply_token_bitmask_reference
            mask(logits, *tensors.token_bitmask)

    @staticmethod
    def _edit(logits: torch.Tensor, tensors: SamplingTensors, on_kernels: bool) -> None:
        """allowed_token_ids, logit_bias, penalties, then banned tokens, in place."""
        if tensors.allowed is not None:
            keep_only(logits, *tensors.allowed)
        if tensors.bias is not None:
            add_bias(logits, *tensors.bias)
        if tensors.penalties is not None:
            p = tensors.penalties
            penalize = penalty_kernels.apply_penalties if on_kernels else apply_penalties
            penalize(logits, p.rows, p.state_rows, p.prompt_mask, p.output_counts, p.repetition, p.frequency,
                     p.presence)
        if tensors.banned is not None:
            ban_tokens(logits, *tensors.banned)

    def probabilities(self, logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
        """[rows, vocab] float32: the law forward() draws each row's token from, written out (speculative
        decoding's rejection sampler weighs drafts with it): the mask and _edit's edits, then
        softmax(x / T) over the tokens min_p, top_k and top_p keep (the same thresholds); a greedy row is
        one-hot at its argmax. The logits are left as they were."""
        if tensors.logits_rows is not None:
            logits = logits[tensors.logits_rows]
        logits = logits.clone()
        on_kernels = self._on_kernels(logits)
        self._mask(logits, tensors, on_kernels)
        self._edit(logits, tensors, on_kernels)
        x = logits.float() if tensors.top_k is None else keep_at_least(logits, self._thresholds(logits, tensors))
        greedy = tensors.temperatures == 0
        probs = torch.softmax(x / torch.where(greedy, 1.0, tensors.temperatures).unsqueeze(1), dim=-1)
        one_hot = torch.zeros_like(probs).scatter_(1, x.argmax(dim=-1, keepdim=True), 1.0)
        return torch.where(greedy.unsqueeze(1), one_hot, probs)

    def draw(self, logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """A keyed draw from softmax(logits / T) over the whole row (argmax where T is 0): the kernels'
        on a GPU, else gumbel_max."""
        return self._draw(logits, temperatures, None, keys)

    @staticmethod
    def _filter_and_draw(logits: torch.Tensor, tensors: SamplingTensors, num_top: int):
        return kernels.filter_and_draw(logits.contiguous(), tensors.temperatures, tensors.keys, tensors.top_k,
                                       tensors.top_p, tensors.min_p, tensors.filter_rows, num_top)

    def _largest(self, logits: torch.Tensor, temperatures: torch.Tensor, k: int):
        """(values, token ids, floors, complete, log_z, z_t): see kernels.sampling.candidates; off the GPU
        (or for more than the kernels serve), every logit: a full sort, floors -inf."""
        if self._on_kernels(logits) and k <= kernels.max_candidates(logits.size(1)):
            values, token_ids, floors, complete, _, log_z, z_t = kernels.candidates(logits, temperatures, k)
            return values, token_ids, floors, complete, log_z, z_t
        x = logits.float()
        values, token_ids = x.sort(dim=1, descending=True, stable=True)
        t = torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(1)
        rows = x.size(0)
        floors = torch.full((rows,), float("-inf"), device=x.device)
        complete = torch.ones(rows, dtype=torch.bool, device=x.device)
        z_t = torch.exp((x - values[:, :1]) / t).sum(1)
        return values, token_ids, floors, complete, torch.logsumexp(x, 1), z_t

    def _thresholds(self, logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
        """Each row's filter threshold: the kernels' (see filter_and_draw), or from a full sort."""
        if self._on_kernels(logits):
            return self._filter_and_draw(logits, tensors, -1)[1]
        values, _, floors, complete, _, z_t = self._largest(logits, tensors.temperatures, logits.size(1))
        return thresholds_from_candidates(values, floors, complete, z_t, tensors.temperatures, tensors.top_k,
                                          tensors.top_p, tensors.min_p, logits.size(1))[0]

    def _draw(self, logits: torch.Tensor, temperatures: torch.Tensor, thresholds: torch.Tensor | None,
              keys: torch.Tensor) -> torch.Tensor:
        """The full-vocabulary draw alone, given thresholds."""
        if self._on_kernels(logits):
            return kernels.sample(logits.contiguous(), temperatures, thresholds, keys)
        return gumbel_max(logits, temperatures, thresholds, keys)


def gumbel_max(logits: torch.Tensor, temperatures: torch.Tensor, thresholds: torch.Tensor | None,
               keys: torch.Tensor) -> torch.Tensor:
    """argmax(x / T + G) over the kept tokens, G Gumbel noise from a generator seeded with the row's key
    (so a row's draw depends on its key alone); rows with temperature 0 take the plain argmax."""
    x = logits.float() if thresholds is None else keep_at_least(logits, thresholds)
    greedy = temperatures == 0
    scaled = x / torch.where(greedy, 1.0, temperatures).unsqueeze(1)
    for row, key in enumerate(keys.tolist()):
        if not greedy[row]:
            u = torch.rand(x.size(1), generator=torch.Generator().manual_seed(key)).to(x.device)
            exponential = (-torch.log(u)).clamp_min(1e-20)
            scaled[row] -= torch.log(exponential)
    return scaled.argmax(dim=-1)
