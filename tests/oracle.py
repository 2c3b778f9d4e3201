"""Hugging Face transformers as the oracle: greedy continuations of the same checkpoint, and the random
token prompts both engines are given."""
import inspect
import random

import torch
from transformers import AutoModelForCausalLM


def random_prompts(n, vocab, lengths, seed=0, shared_prefix=()):
    """n prompts of ids in [0, vocab) with lengths uniform in `lengths` (inclusive), after shared_prefix."""
    rng = random.Random(seed)
    return [list(shared_prefix) + [rng.randrange(vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def load_hf_model(model_dir, dtype=torch.float32, device="cpu"):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """Argmax decoding with transformers' own KV cache; stops after eos_token_id if one is given."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([prompt_ids], device=device)
    out = model(input_ids=input_ids, use_cache=True)
    cache_key = _cache_key(model)
    generated = []
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
        if token == eos_token_id:
            break
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        out = model(input_ids=torch.tensor([[token]], device=device), use_cache=True, **{cache_key: cache})
    return generated


def _cache_key(model) -> str:
    """The argument the model's forward takes its KV cache by: `cache` from transformers 5.2x on (which deprecates
    `past_key_values` and drops it in 5.40), `past_key_values` before (the GPU image's 5.17)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
