import pytest

from nanovllm import SamplingParams

pytestmark = pytest.mark.cpu_only     # validation only


def test_defaults_and_greedy_zero_temperature():
    assert SamplingParams() == SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=False)
    assert SamplingParams(temperature=0).temperature == 0.0


@pytest.mark.parametrize("kwargs, error", [
    (dict(temperature=-0.1), ValueError),
    (dict(temperature=float("nan")), ValueError),
    (dict(temperature=float("inf")), ValueError),
    (dict(temperature="hot"), TypeError),
    (dict(max_tokens=0), ValueError),
    (dict(max_tokens=2.5), TypeError),
    (dict(max_tokens=True), TypeError),
    (dict(ignore_eos=1), TypeError),
])
def test_rejects_bad_values_with_a_message_naming_them(kwargs, error):
    name = next(iter(kwargs))
    with pytest.raises(error, match=name):
        SamplingParams(**kwargs)
