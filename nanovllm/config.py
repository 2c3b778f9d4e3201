# torch, transformers and the quantization layers are imported where a Config is checked, not with this
# module (its annotations stay text): the command line lists Config's fields without them (`nanovllm --help`)
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field, fields
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING

from nanovllm.models import model_class

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from nanovllm.layers.quantization import QuantizationMethod

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 4096
DEVICES = ("auto", "cuda", "cpu")
DTYPES = ("float32", "float16", "bfloat16")     # names of torch dtypes
ATTENTION_BACKENDS = ("auto", "flash_attn", "triton", "torch")
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn"}   # None: the model's dtype; else a torch dtype's name
LOAD_FORMATS = ("auto", "dummy")   # dummy: seeded random weights from config.json alone (benchmarks of big shapes)
CPU_KV_CACHE_BYTES = 512 << 20   # the CPU's default KV budget: modest, fixed, independent of free RAM
# reasoning parser -> (start, end) markers of a model's thinking: a structured output constrains the answer
# after the end marker, not the thinking (the server also splits the text there: entrypoints/reasoning_parsers)
REASONING_MARKERS = {"qwen3": ("<think>", "</think>"), "deepseek_r1": ("<think>", "</think>")}
SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle3")     # speculative_config["method"]: what runs today
SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                    "adaptive")


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bound}, got {value}")


# what a checkpoint directory fetched from the Hub leaves out: other formats of the same weights
HUB_IGNORE = ["*.bin", "*.pt", "*.pth", "*.gguf", "*.onnx", "*.msgpack", "*.h5", "original/*", "consolidated*"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _fetch_from_hub(repo_id: str, needs_weights: bool) -> Path:
    """A Hugging Face Hub repository id (org/name) as vLLM takes it: its checkpoint in the local Hub cache,
    downloaded there if it is not yet (safetensors weights only; none for load_format="dummy")."""
    try:
        from huggingface_hub import snapshot_download
        ignore = HUB_IGNORE + ([] if needs_weights else ["*.safetensors"])
        return Path(snapshot_download(repo_id, ignore_patterns=ignore))
    except Exception as error:      # no network, no such repository, a gated one: say which
        raise FileNotFoundError(f"model directory not found: {repo_id!r}, and fetching it from the Hugging Face "
                                f"Hub as a repository id failed ({type(error).__name__}: {error})") from None


def _check_model_dir(model, needs_weights: bool = True) -> Path:
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a path to a Hugging Face checkpoint directory, got {model!r}")
    path = Path(model)
    if not path.exists() and isinstance(model, str) and _REPO_ID.match(model):
        path = _fetch_from_hub(model, needs_weights)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory not found: {str(model)!r}")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(model)!r} has no config.json")
    if needs_weights and not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"model directory {str(model)!r} has no *.safetensors weights "
                                f"(load_format='dummy' runs random weights from config.json alone)")
    return path


@dataclass
class Config:
    """Everything the engine needs to know, checked once here so that nothing below has to."""
    model: str
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    max_model_len: int = DEFAULT_MAX_MODEL_LEN       # cut to the model's max_position_embeddings
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 16384
    gpu_memory_utilization: float = 0.9
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1
    device: str = "auto"
    dtype: str | torch.dtype = "auto"
    attention_backend: str = "auto"
    kv_cache_dtype: str | torch.dtype = "auto"
    enable_prefix_caching: bool = True
    disable_custom_all_reduce: bool = False
    load_format: str = "auto"
    quantization: str | None = None     # a registered quantization method's name (layers/quantization), e.g.
                                        # FP8 weights quantized online; a quantized checkpoint needs none
    reasoning_parser: str | None = None     # "qwen3" or "deepseek_r1": structured outputs start after the thinking
    # speculative decoding, vLLM's keys: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
    # "prompt_lookup_min": 2} or {"method": "draft_model", "model": DIR, "num_speculative_tokens": k} (a smaller
    # checkpoint with the target's vocabulary); checked and completed (defaults filled in) here. Ours beside them:
    # "adaptive" (default True): speculate only where it measures faster (engine/spec_decode.py's
    # SpeculationPolicy); False: on every decode step
    speculative_config: dict | None = None
    hf_config: PretrainedConfig = field(init=False, repr=False)
    quant_method: QuantizationMethod = field(init=False, default=None)   # layers/quantization; set when checked
    draft_hf_config: PretrainedConfig | None = field(init=False, default=None, repr=False)   # a draft_model's
    eos_token_ids: frozenset[int] = field(init=False, default=frozenset())

    @classmethod
    def check_arguments(cls, kwargs: dict) -> None:
        """Refuse LLM(...) keyword arguments that are not settings, naming those that are."""
        names = {f.name for f in fields(cls) if f.init} - {"model"}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown argument(s) {unknown}; LLM takes: {sorted(names)}")

    def __post_init__(self):
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        path = _check_model_dir(self.model, needs_weights=self.load_format == "auto")
        self.model = str(path)
        for name in ("enforce_eager", "enable_prefix_caching", "disable_custom_all_reduce"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1, 8)
        _check_int("max_model_len", self.max_model_len, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("kvcache_block_size", self.kvcache_block_size, 1)
        _check_int("num_kvcache_blocks", self.num_kvcache_blocks, -1)
        if self.num_kvcache_blocks == 0:
            raise ValueError("num_kvcache_blocks must be -1 (size from memory) or > 0, got 0")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_MARKERS:
            raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_MARKERS)} or None, "
                             f"got {self.reasoning_parser!r}")
        self._check_speculative_config()
        gmu = self.gpu_memory_utilization
        if isinstance(gmu, bool) or not isinstance(gmu, (int, float)) or not 0.0 < gmu <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {gmu!r}")

        self._resolve_device()
        from transformers import AutoConfig
        self.hf_config = AutoConfig.from_pretrained(self.model)
        model_cls = model_class(self.hf_config)   # a clear error for architectures and variants we lack
        if "sliding_attention" in (getattr(self.hf_config, "layer_types", None) or []):
            raise ValueError(f"{self.model!r} uses sliding-window attention layers, which are not supported")
        self._fit_max_model_len()
        if hasattr(model_cls, "check_config"):
            model_cls.check_config(self.hf_config, self.tensor_parallel_size, self.max_model_len)
        self._resolve_dtype()
        self._resolve_quantization()
        self._resolve_kv_cache_dtype()
        self._resolve_attention_backend()
        self._check_tensor_parallel()
        self._load_draft_config()
        eos = getattr(self.hf_config, "eos_token_id", None)
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))

    def _fit_max_model_len(self) -> None:
        """Cut to the model's max_position_embeddings (positions past it were never trained), saying so
        unless it is the default: a length asked for and not given should not go unnoticed."""
        limit = self.hf_config.max_position_embeddings
        if self.max_model_len > limit and self.max_model_len != DEFAULT_MAX_MODEL_LEN:
            logger.warning("max_model_len=%d is more than the model's max_position_embeddings (%d, in %s): "
                           "using %d", self.max_model_len, limit, Path(self.model) / "config.json", limit)
        self.max_model_len = min(self.max_model_len, limit)

    def _check_speculative_config(self) -> None:
        """vLLM's names and defaults: n-gram lookup bounds default to each other, or both to 5."""
        spec = self.speculative_config
        if spec is None:
            return
        if not isinstance(spec, dict):
            raise TypeError(f"speculative_config must be a dict (or None), got {spec!r}")
        unknown = sorted(set(spec) - set(SPECULATIVE_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; it takes {list(SPECULATIVE_KEYS)}")
        method = spec.get("method")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method must be one of {list(SPECULATIVE_METHODS)}, got {method!r}")
        if "num_speculative_tokens" not in spec:
            raise ValueError("speculative_config: num_speculative_tokens is required (the drafts per step, >= 1)")
        if method in ("draft_model", "eagle3"):
            self._check_draft_model_keys(spec)
            return
        if "model" in spec:
            raise ValueError(f"speculative_config: method {method!r} takes no model (draft_model and eagle3 do)")
        lookup_max, lookup_min = spec.get("prompt_lookup_max"), spec.get("prompt_lookup_min")
        if lookup_max is None and lookup_min is None:
            lookup_max = lookup_min = 5
        elif lookup_max is None:
            lookup_max = lookup_min
        elif lookup_min is None:
            lookup_min = lookup_max
        checked = {"method": method, "num_speculative_tokens": spec["num_speculative_tokens"],
                   "prompt_lookup_max": lookup_max, "prompt_lookup_min": lookup_min}
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = checked[name]
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"speculative_config: {name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"speculative_config: {name} must be >= 1, got {value}")
        if lookup_min > lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lookup_min}) must be <= "
                             f"prompt_lookup_max ({lookup_max})")
        checked["adaptive"] = spec.get("adaptive", True)
        if not isinstance(checked["adaptive"], bool):
            raise ValueError(f"speculative_config: adaptive must be true or false, got {checked['adaptive']!r}")
        self.speculative_config = checked

    def _check_draft_model_keys(self, spec: dict) -> None:
        """draft_model and eagle3: a checkpoint directory (its weights unless load_format is dummy) and k."""
        method = spec["method"]
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if name in spec:
                raise ValueError(f"speculative_config: {name} is an ngram setting; {method} does not take it")
        if "model" not in spec:
            raise ValueError(f"speculative_config: {method} needs model, the draft checkpoint's directory")
        try:
            path = _check_model_dir(spec["model"], needs_weights=self.load_format == "auto")
        except (TypeError, FileNotFoundError) as error:
            raise ValueError(f"speculative_config: model: {error}") from None
        k = spec["num_speculative_tokens"]
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an int >= 1, got {k!r}")
        adaptive = spec.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(f"speculative_config: adaptive must be true or false, got {adaptive!r}")
        self.speculative_config = {"method": method, "model": str(path), "num_speculative_tokens": k,
                                   "adaptive": adaptive}

    def _load_draft_config(self) -> None:
        """A draft model's config: an architecture we run, the target's vocabulary (the target checks the
        draft's tokens by id), heads that split over the same tensor-parallel ranks."""
        spec = self.speculative_config
        if spec is None or spec["method"] not in ("draft_model", "eagle3"):
            return
        from transformers import AutoConfig
        draft = AutoConfig.from_pretrained(spec["model"])
        if spec["method"] == "eagle3":
            self._check_eagle3_head(draft)
            return
        try:
            draft_class = model_class(draft)
            if hasattr(draft_class, "check_config"):
                draft_class.check_config(draft, self.tensor_parallel_size, self.max_model_len)
        except ValueError as error:
            raise ValueError(f"speculative_config: the draft model: {error}") from None
        if draft.max_position_embeddings < self.max_model_len:
            raise ValueError(f"speculative_config: the draft model's max_position_embeddings "
                             f"({draft.max_position_embeddings}) is below max_model_len ({self.max_model_len})")
        if draft.vocab_size != self.hf_config.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocab_size ({draft.vocab_size}) differs from "
                             f"the target's ({self.hf_config.vocab_size}): a draft must share the vocabulary")
        self._check_draft_heads(draft, "the draft model")
        self.draft_hf_config = draft

    def _check_eagle3_head(self, head) -> None:
        """An EAGLE-3 head: its published layout (models/eagle3.py), the target's vocabulary (its own draft
        vocabulary within it), the target layers it reads, heads that split over the ranks."""
        from nanovllm.models.eagle3 import EAGLE3_ARCHITECTURES, aux_hidden_layer_ids
        architectures = getattr(head, "architectures", None) or []
        if not set(architectures) & set(EAGLE3_ARCHITECTURES):
            raise ValueError(f"speculative_config: eagle3 needs an EAGLE-3 head ({' or '.join(EAGLE3_ARCHITECTURES)}"
                             f" in its config.json), got architectures {architectures}")
        if getattr(head, "num_hidden_layers", 1) != 1:
            raise ValueError(f"speculative_config: an EAGLE-3 head has one layer, this one {head.num_hidden_layers}")
        if head.vocab_size != self.hf_config.vocab_size:
            raise ValueError(f"speculative_config: the EAGLE-3 head's vocab_size ({head.vocab_size}) differs from the "
                             f"target's ({self.hf_config.vocab_size}): it was trained for another model")
        draft_vocab = getattr(head, "draft_vocab_size", None) or head.vocab_size
        if draft_vocab > head.vocab_size:
            raise ValueError(f"speculative_config: the EAGLE-3 head's draft_vocab_size ({draft_vocab}) exceeds "
                             f"its vocab_size ({head.vocab_size})")
        if getattr(head, "hidden_act", "silu") != "silu":
            raise ValueError(f"speculative_config: the EAGLE-3 head's hidden_act {head.hidden_act!r} is not 'silu'")
        try:
            aux_hidden_layer_ids(head, self.hf_config.num_hidden_layers)
        except ValueError as error:
            raise ValueError(f"speculative_config: {error}") from None
        self._check_draft_heads(head, "the EAGLE-3 head")
        self.draft_hf_config = head

    def _check_draft_heads(self, draft, what: str) -> None:
        """A drafter is split over the target's tensor-parallel ranks: its heads must divide among them."""
        tp = self.tensor_parallel_size
        for name in ("num_attention_heads", "num_key_value_heads"):
            if getattr(draft, name) % tp:
                raise ValueError(f"speculative_config: {what}'s {name} ({getattr(draft, name)}) is not "
                                 f"divisible by tensor_parallel_size ({tp})")

    def _resolve_device(self) -> None:
        import torch
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        elif self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for, but no CUDA device is available")

    def _resolve_dtype(self) -> None:
        import torch
        dtypes = {name: getattr(torch, name) for name in DTYPES}
        if isinstance(self.dtype, torch.dtype):
            if self.dtype not in dtypes.values():
                raise ValueError(f"dtype must be one of {list(DTYPES)} or 'auto', got {self.dtype}")
            return
        if self.dtype == "auto":
            if self.device == "cpu":
                self.dtype = torch.float32
            else:
                saved = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
                if isinstance(saved, str):
                    saved = dtypes.get(saved)
                self.dtype = saved if saved in dtypes.values() else torch.bfloat16
        elif self.dtype in dtypes:
            self.dtype = dtypes[self.dtype]
        else:
            raise ValueError(f"dtype must be one of {list(DTYPES)} or 'auto', got {self.dtype!r}")

    def _resolve_quantization(self) -> None:
        """The quantization method (layers/quantization's registry): what the checkpoint's quantization_config
        says (refused by name unless a registered method reads it), or quantization=name on an unquantized
        checkpoint (online); the model's dtype otherwise. `quantization` ends up the name of the method the
        weights will have (None: unquantized)."""
        from nanovllm.layers.quantization import resolve_quantization
        where = f"{self.model!r}'s config.json"
        self.quant_method = resolve_quantization(self.hf_config, self.quantization, where, self.load_format)
        self.quantization = self.quant_method.name
        self.quant_method.check_device(self.device)

    def _resolve_kv_cache_dtype(self) -> None:
        """"auto": the model's dtype; "fp8": float8_e4m3fn, K and V stored as they are (scale 1.0) and
        saturated at +-448 (README, "FP8 KV cache")."""
        import torch
        if self.kv_cache_dtype in (self.dtype, torch.float8_e4m3fn):
            return
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        name = KV_CACHE_DTYPES[self.kv_cache_dtype]
        self.kv_cache_dtype = getattr(torch, name) if name else self.dtype

    def _resolve_attention_backend(self) -> None:
        import torch
        backend, block_size = self.attention_backend, self.kvcache_block_size
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
        has_flash_attn = find_spec("flash_attn") is not None
        fp8 = self.kv_cache_dtype == torch.float8_e4m3fn
        if backend == "auto":
            if self.device == "cpu":
                backend = "torch"
            else:   # flash-attn 2 reads no fp8 cache: an fp8 cache always takes our Triton kernels
                backend = "flash_attn" if has_flash_attn and block_size % 256 == 0 and not fp8 else "triton"
        if backend == "flash_attn":
            if fp8:
                raise ValueError("attention_backend='flash_attn' cannot read an fp8 KV cache; use "
                                 "kv_cache_dtype='auto', or attention_backend='triton' (or 'auto', which picks it)")
            if self.device != "cuda" or not has_flash_attn:
                raise ValueError("attention_backend='flash_attn' needs CUDA and the flash-attn package")
            if block_size % 256 != 0:
                raise ValueError(f"attention_backend='flash_attn' needs kvcache_block_size to be a multiple "
                                 f"of 256, got {block_size}")
        else:
            if block_size < 16 or block_size & (block_size - 1):
                raise ValueError(f"kvcache_block_size must be a power of two >= 16 for the {backend} "
                                 f"attention backend, got {block_size}")
        if backend == "triton" and self.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend='triton' on CPU needs TRITON_INTERPRET=1 (slow); use 'torch'")
        self.attention_backend = backend

    def _check_tensor_parallel(self) -> None:
        import torch
        tp, hf = self.tensor_parallel_size, self.hf_config
        if self.device == "cuda" and tp > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={tp} exceeds the {torch.cuda.device_count()} CUDA device(s)")
        for name in ("num_attention_heads", "num_key_value_heads", "vocab_size"):
            if getattr(hf, name) % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide {name}={getattr(hf, name)}")
