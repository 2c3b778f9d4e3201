"""What the engine refuses, in one place: LLMEngine checks a request before it touches any state, and
AsyncLLM checks it in the server's process before sending it to the engine's (so a bad request is a 400
before any stream starts)."""
from dataclasses import dataclass

from nanovllm.engine.structured_output import check_structured_outputs
from nanovllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against: the vocabulary, the context, the KV cache's size and the
    end-of-sequence ids (which min_tokens bans as it bans stop tokens)."""
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    eos_token_ids: frozenset[int] = frozenset()


def checked_request(tokenizer, prompt: str | list[int] | dict, sampling_params: SamplingParams,
                    limits: RequestLimits) -> list[int]:
    """The prompt's token ids, once the whole request is checked (the sampling params' type first); with
    truncate_prompt_tokens, its last that many (-1: max_model_len)."""
    if not isinstance(sampling_params, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
    token_ids = prompt_token_ids(tokenizer, prompt, limits.vocab_size)
    keep = sampling_params.truncate_prompt_tokens
    if keep is not None:        # the prompt's last tokens (left truncation, as vLLM)
        token_ids = token_ids[-(limits.max_model_len if keep == -1 else keep):]
    check_request(token_ids, sampling_params, limits)
    return token_ids


# vLLM's prompt dicts (TextPrompt, TokensPrompt): one of these keys
PROMPT_KEYS = ("prompt", "prompt_token_ids")


def prompt_token_ids(tokenizer, prompt: str | list[int] | dict, vocab_size: int) -> list[int]:
    """A prompt (text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}) as checked token ids."""
    if isinstance(prompt, dict):
        unknown = sorted(set(prompt) - set(PROMPT_KEYS))
        if unknown:
            raise ValueError(f"a prompt dict takes one of {list(PROMPT_KEYS)}; {unknown} not supported")
        if len(prompt) != 1:
            raise ValueError(f"a prompt dict takes exactly one of {list(PROMPT_KEYS)}, got {sorted(prompt)}")
        (key, prompt), = prompt.items()
        if key == "prompt" and not isinstance(prompt, str):
            raise TypeError(f"a prompt dict's \"prompt\" must be a str, got {type(prompt).__name__}")
        if key == "prompt_token_ids" and not isinstance(prompt, (list, tuple)):
            raise TypeError(f"a prompt dict's \"prompt_token_ids\" must be a list of ints, got {type(prompt).__name__}")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is an empty string")
        token_ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise TypeError("a token-id prompt must be a list of ints")
        token_ids = list(prompt)
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    else:
        raise TypeError(f"a prompt must be a str or a list of token ids, got {type(prompt).__name__}")
    if not token_ids:
        raise ValueError("prompt has no tokens")
    return token_ids


def check_request(token_ids: list[int], sampling_params: SamplingParams, limits: RequestLimits) -> None:
    """Raise ValueError/TypeError, naming the problem, for a request that could never run. n completions
    that do not fit at once are not refused: they start as room frees up."""
    if not isinstance(sampling_params, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
    max_len = limits.max_model_len
    if len(token_ids) >= max_len:
        raise ValueError(f"prompt of {len(token_ids)} tokens leaves no room to generate within "
                         f"max_model_len={max_len}")
    bad = [t for t in sampling_params.stop_token_ids if t >= limits.vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids holds {bad[0]}, outside the vocabulary [0, {limits.vocab_size})")
    for name, ids in (("logit_bias", sampling_params.logit_bias or ()),
                      ("allowed_token_ids", sampling_params.allowed_token_ids or ())):
        bad = [t for t in ids if t >= limits.vocab_size]
        if bad:
            raise ValueError(f"{name} holds token id {bad[0]}, outside the vocabulary [0, {limits.vocab_size})")
    check_min_tokens_leave_a_token(sampling_params, limits.eos_token_ids)
    check_structured_outputs(sampling_params.structured_outputs)
    room = max_len if sampling_params.max_tokens is None else sampling_params.max_tokens     # None: to max_model_len
    longest = min(len(token_ids) + room, max_len)
    if (longest + limits.block_size - 1) // limits.block_size > limits.num_blocks:
        raise ValueError(f"a request of up to {longest} tokens can never fit in the KV cache of "
                         f"{limits.num_blocks} blocks of {limits.block_size} tokens; lower max_tokens or "
                         f"give the cache more blocks")


def check_min_tokens_leave_a_token(sampling_params: SamplingParams, eos_token_ids: frozenset[int]) -> None:
    """If what min_tokens bans until that many tokens exist is all allowed_token_ids allows, no token could
    be sampled (a row of -inf logits)."""
    p = sampling_params
    if not p.min_tokens or p.allowed_token_ids is None:
        return
    if p.min_tokens_bans(eos_token_ids).issuperset(p.allowed_token_ids):
        raise ValueError(f"every token allowed_token_ids allows is a stop token or eos, which min_tokens="
                         f"{p.min_tokens} bans until {p.min_tokens} tokens exist: no token could be sampled")
