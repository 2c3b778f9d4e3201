"""The rotary cos/sin table: one per model, shared by its layers (a per-layer copy of a 40,960-position table
took 0.94 GiB of Qwen3-30B-A3B's KV room), built on the device the model is built on, freed with the model."""
import gc

import pytest
import torch

from nanovllm import LLM
from nanovllm.layers import rotary_kv_store
from nanovllm.layers.rotary_kv_store import RotaryEmbedding, cos_sin_table

pytestmark = pytest.mark.cpu_only


def test_the_table_holds_each_positions_cos_and_sin():
    table = cos_sin_table(8, 5, 10000.0)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 8, 2).float() / 8)
    angles = torch.arange(5).float()[:, None] * inv_freq
    assert table.shape == (5, 8) and table.dtype == torch.float32
    torch.testing.assert_close(table, torch.cat((angles.cos(), angles.sin()), dim=-1))


def test_layers_built_alike_share_one_table_and_others_do_not():
    a, b = RotaryEmbedding(64, 128, 10000.0), RotaryEmbedding(64, 128, 10000.0)
    assert a.cos_sin_cache is b.cos_sin_cache
    others = [RotaryEmbedding(64, 256, 10000.0), RotaryEmbedding(32, 128, 10000.0), RotaryEmbedding(64, 128, 5e5),
              RotaryEmbedding(64, 128, 10000.0, dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                      original_max_position_embeddings=64))]
    assert len({id(r.cos_sin_cache) for r in [a] + others}) == len(others) + 1
    with torch.device("meta"):
        on_meta = RotaryEmbedding(64, 128, 10000.0)
    assert on_meta.cos_sin_cache.is_meta and not a.cos_sin_cache.is_meta


def test_a_dropped_models_table_is_freed():
    rope = RotaryEmbedding(16, 4096 + 17, 10000.0)
    key_count = len(rotary_kv_store._tables)
    del rope
    gc.collect()
    assert len(rotary_kv_store._tables) == key_count - 1


def test_an_engines_layers_share_one_table(tiny_model):
    with LLM(tiny_model, device="cpu", max_model_len=128) as llm:
        layers = llm.model_runner.model.model.layers
        tables = {id(layer.self_attn.rotary_emb.cos_sin_cache) for layer in layers}
        assert len(layers) >= 2 and len(tables) == 1
