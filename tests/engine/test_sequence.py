import pickle

from nanovllm import SamplingParams
from nanovllm.engine.sequence import Sequence, SequenceStatus
import pytest

pytestmark = pytest.mark.cpu_only     # host bookkeeping only


def make(tokens, block_size=4, **kw):
    return Sequence(tokens, SamplingParams(**kw), block_size)


def test_views_and_blocks():
    seq = make(list(range(10)), max_tokens=5)
    assert seq.status == SequenceStatus.WAITING
    assert (len(seq), seq.num_blocks, seq.last_block_num_tokens) == (10, 3, 2)
    assert seq.block(2) == [8, 9]
    seq.append_token(42)
    assert seq.prompt_token_ids == list(range(10))
    assert seq.completion_token_ids == [42]
    assert (seq.last_token, seq.num_completion_tokens, seq.num_blocks) == (42, 1, 3)


def test_ids_are_unique_and_increasing():
    a, b = make([1]), make([1])
    assert b.seq_id > a.seq_id


def test_pickle_sends_all_tokens_while_prefilling_and_only_the_last_in_decode():
    seq = make(list(range(1000)), temperature=0.5)
    seq.block_table = [3, 1, 4]
    prefill = pickle.loads(pickle.dumps(seq))
    assert prefill.token_ids == seq.token_ids and prefill.block_table == [3, 1, 4]
    assert prefill.seq_id == seq.seq_id     # sampling parameters stay on rank 0, which samples

    seq.num_cached_tokens = 1000
    seq.append_token(7)           # decode: only the new token is uncomputed
    decode_bytes = pickle.dumps(seq)
    decode = pickle.loads(decode_bytes)
    assert decode.token_ids == [] and decode.last_token == 7
    assert (len(decode), decode.num_cached_tokens, decode.last_block_num_tokens) == (1001, 1000, 1)
    assert len(decode_bytes) < 200 < len(pickle.dumps(prefill))


def test_preempted_sequence_is_resent_in_full():
    seq = make(list(range(20)))
    seq.num_cached_tokens = 20
    seq.append_token(5)
    seq.num_cached_tokens = 0     # preempted: its KV is gone and must be recomputed
    assert pickle.loads(pickle.dumps(seq)).token_ids == list(range(20)) + [5]
