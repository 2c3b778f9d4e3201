"""Write a random-weight Hugging Face checkpoint of any supported shape, with a byte-level tokenizer.

For tests and benchmarks where no real weights can be fetched (nothing in nanovllm/ needs it at run time,
so it lives beside the benchmarks; import it from the repository's root, as bench.py and the tests do):

    from benchmarks.random_checkpoint import write_random_checkpoint
    write_random_checkpoint("/tmp/tiny-qwen3", hidden_size=64, num_hidden_layers=2, vocab_size=512)

The directory holds config.json, model.safetensors and tokenizer files, and loads unchanged in both
transformers and nanovllm. Weights are drawn from a seeded generator, so a shape and seed always give
the same checkpoint. The tokenizer covers the whole vocabulary: the 256 byte symbols first (text encodes
byte by byte), then filler tokens, then the special tokens at the top.
"""
from pathlib import Path

import torch

QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                     vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False)    # its MoE layers' experts: 128 x 3 x 2048 x 768 weights each


def projection_shapes(shape: dict) -> dict[str, tuple[int, int]]:
    """A dense Qwen3 shape's four projections of a layer as (N, K) of their [N, K] weights, q, k and v merged and
    gate and up merged as the engine holds them."""
    hidden, inter, head_dim = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim),
            "gate_up": (2 * inter, hidden), "down": (hidden, inter)}


MODEL_TYPES = {"Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama",
               "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral"}
# a small default mixture for tests: 8 experts, each token's top 2
TINY_EXPERTS = {"Qwen3MoeForCausalLM": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
                "MixtralForCausalLM": dict(num_local_experts=8, num_experts_per_tok=2)}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_level_tokenizer(vocab_size: int):
    """A fast tokenizer whose ids cover [0, vocab_size): any random token id decodes to something."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    num_fillers = vocab_size - 256 - len(SPECIAL_TOKENS)
    n = 0
    while len(vocab) < 256 + num_fillers:     # filler tokens: 2- then 3-symbol strings, in order
        width = 2 if n < 256 ** 2 else 3
        digits, m = [], n if width == 2 else n - 256 ** 2
        for _ in range(width):
            digits.append(alphabet[m % 256])
            m //= 256
        vocab["".join(digits)] = len(vocab)
        n += 1
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def write_random_checkpoint(path: str | Path, architecture: str = "Qwen3ForCausalLM",
                            dtype: torch.dtype = torch.float32, seed: int = 0, device: str = "cpu",
                            weights: bool = True, **config_overrides) -> Path:
    """Write a checkpoint directory; config_overrides set the shape (transformers config fields).
    `device` is where the weights are drawn: a GPU draws an 8B model in seconds (other numbers than
    the CPU's generator gives for the same seed). weights=False writes config.json and the tokenizer
    only, for LLM(..., load_format="dummy") (a 30B shape without writing 61 GB)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = MODEL_TYPES[architecture]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    settings = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048, tie_word_embeddings=False)
    settings.update(TINY_EXPERTS.get(architecture, {}))
    settings.update(config_overrides)
    settings.setdefault("initializer_range", settings["hidden_size"] ** -0.5)
    tokenizer = byte_level_tokenizer(settings["vocab_size"])
    settings.setdefault("eos_token_id", tokenizer.eos_token_id)
    settings.setdefault("bos_token_id", tokenizer.eos_token_id)
    settings.setdefault("pad_token_id", tokenizer.eos_token_id)
    config = AutoConfig.for_model(model_type, architectures=[architecture], **settings)
    if not weights:
        config.dtype = dtype
        config.save_pretrained(path)
        tokenizer.save_pretrained(path)
        return path
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default_dtype)
    with torch.no_grad():             # norms at exactly one (biases at zero) would hide a mix-up of their weights
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.8, 1.2)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()         # an engine started next sizes its KV cache from free memory
    return path


def write_random_eagle3_head(path: str | Path, target: str | Path, draft_vocab_size: int | None = None,
                             aux_layer_ids: list[int] | None = None, seed: int = 0, dtype: torch.dtype = torch.float32,
                             weights: bool = True, **config_overrides) -> Path:
    """An EAGLE-3 head for the checkpoint in `target`, in the published layout (nanovllm/models/eagle3.py):
    config.json ("LlamaForCausalLMEagle3", one layer, the target's vocab_size, draft_vocab_size,
    eagle_config.eagle_aux_hidden_state_layer_ids) and model.safetensors (fc, midlayer.*, norm, lm_head, d2t
    when the draft vocabulary is a subset: the target ids of draft ids 0.. are an increasing random pick).
    config_overrides set the head's shape (default: the target's hidden size, heads and head_dim, 2 x
    hidden intermediate)."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoConfig

    target_config = AutoConfig.from_pretrained(target)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hidden = config_overrides.get("hidden_size", target_config.hidden_size)
    heads = config_overrides.get("num_attention_heads", target_config.num_attention_heads)
    settings = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=hidden,
                    num_attention_heads=heads,
                    num_key_value_heads=config_overrides.get("num_key_value_heads", target_config.num_key_value_heads),
                    head_dim=config_overrides.get("head_dim", getattr(target_config, "head_dim", None) or hidden // heads),
                    intermediate_size=2 * hidden, num_hidden_layers=1, vocab_size=target_config.vocab_size,
                    draft_vocab_size=draft_vocab_size or target_config.vocab_size, hidden_act="silu",
                    rms_norm_eps=target_config.rms_norm_eps, rope_theta=getattr(target_config, "rope_theta", 10000.0),
                    max_position_embeddings=target_config.max_position_embeddings, tie_word_embeddings=False,
                    target_hidden_size=target_config.hidden_size, torch_dtype=str(dtype).removeprefix("torch."))
    settings.update(config_overrides)
    if aux_layer_ids is not None:
        settings["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
    (path / "config.json").write_text(json.dumps(settings, indent=2))
    if not weights:
        return path
    generator = torch.Generator().manual_seed(seed)
    h, hd, t = settings["hidden_size"], settings["head_dim"], target_config.hidden_size
    q, kv, inter, dv = settings["num_attention_heads"] * hd, settings["num_key_value_heads"] * hd, \
        settings["intermediate_size"], settings["draft_vocab_size"]

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=generator) * cols ** -0.5).to(dtype)

    def norm() -> torch.Tensor:
        return (0.8 + 0.4 * torch.rand(h, generator=generator)).to(dtype)

    tensors = {"fc.weight": matrix(h, 3 * t),
               "midlayer.self_attn.q_proj.weight": matrix(q, 2 * h), "midlayer.self_attn.k_proj.weight": matrix(kv, 2 * h),
               "midlayer.self_attn.v_proj.weight": matrix(kv, 2 * h), "midlayer.self_attn.o_proj.weight": matrix(h, q),
               "midlayer.mlp.gate_proj.weight": matrix(inter, h), "midlayer.mlp.up_proj.weight": matrix(inter, h),
               "midlayer.mlp.down_proj.weight": matrix(h, inter), "midlayer.input_layernorm.weight": norm(),
               "midlayer.hidden_norm.weight": norm(), "midlayer.post_attention_layernorm.weight": norm(),
               "norm.weight": norm(), "lm_head.weight": matrix(dv, h)}
    if dv != target_config.vocab_size:
        picked = torch.randperm(target_config.vocab_size, generator=generator)[:dv].sort().values
        tensors["d2t"] = picked - torch.arange(dv)
        tensors["t2d"] = torch.zeros(target_config.vocab_size, dtype=torch.bool).index_fill_(0, picked, True)
    save_file(tensors, str(path / "model.safetensors"))
    return path
