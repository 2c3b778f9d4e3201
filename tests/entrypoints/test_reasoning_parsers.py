"""The reasoning parsers split a chat choice's text into thinking and answer, as vLLM's --reasoning-parser
names them; fed in any split (a stream's deltas), they add up to what the whole text gives."""
import random

import pytest

from nanovllm.entrypoints.reasoning_parsers import REASONING_PARSERS, DeepSeekR1ReasoningParser, \
    Qwen3ReasoningParser, held_prefix, reasoning_parser

pytestmark = pytest.mark.cpu_only     # text parsing only

QWEN3_THINKING_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
QWEN3_NO_THINKING_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"

R1_CLOSED_PROMPT = ("<｜User｜>hi<｜Assistant｜><think>greet back</think>Hello!<｜end▁of▁sentence｜>"
                    "<｜User｜>What is the weather in Oslo today?<｜Assistant｜>")
R1_EMPTY_THOUGHT_PROMPT = "<｜User｜>2+2?<｜Assistant｜><think>\n\n</think>\n\n"
R1_OPEN_PROMPT = R1_CLOSED_PROMPT + "<think>\n"

CASES = [   # (parser, prompt, output, (reasoning, content))
    (Qwen3ReasoningParser, "", "<think>\nLet me see.\n</think>\n\nParis.", ("\nLet me see.\n", "\n\nParis.")),
    (Qwen3ReasoningParser, "", "Paris.", (None, "Paris.")),
    (Qwen3ReasoningParser, "", "<think>only thinking, cut off", ("only thinking, cut off", None)),
    (Qwen3ReasoningParser, "", "<think></think>answer", (None, "answer")),
    (Qwen3ReasoningParser, "", "a <think>b</think> c", (None, "a <think>b</think> c")),   # not at the start
    (Qwen3ReasoningParser, "", "<thin", (None, "<thin")),               # a partial marker is text
    (Qwen3ReasoningParser, "", "<think>x</thi", ("x</thi", None)),
    (Qwen3ReasoningParser, QWEN3_THINKING_PROMPT, "hmm</think>\n\nParis.", ("hmm", "\n\nParis.")),
    (Qwen3ReasoningParser, QWEN3_NO_THINKING_PROMPT, "Paris.</think>", (None, "Paris.</think>")),
    (DeepSeekR1ReasoningParser, "", "step 1, step 2</think>The answer is 4.", ("step 1, step 2", "The answer is 4.")),
    (DeepSeekR1ReasoningParser, "", "<think>step</think>4", ("step", "4")),    # its own opening tag dropped
    (DeepSeekR1ReasoningParser, "", "no end marker at all", ("no end marker at all", None)),
    (DeepSeekR1ReasoningParser, "", "a</think>b</think>c", ("a", "b</think>c")),
    (DeepSeekR1ReasoningParser, "", "", (None, None)),
    # the prompt's last marker closes the thinking (an earlier turn's kept, an empty one the template closed):
    # the output is the answer from its start
    (DeepSeekR1ReasoningParser, R1_CLOSED_PROMPT, '{"city": "Oslo"}', (None, '{"city": "Oslo"}')),
    (DeepSeekR1ReasoningParser, R1_EMPTY_THOUGHT_PROMPT, "4</think>", (None, "4</think>")),
    (DeepSeekR1ReasoningParser, R1_CLOSED_PROMPT, "<think>step</think>4", ("step", "4")),   # the model reopens it
    # ... and its last marker opening one: reasoning, as with no marker at all
    (DeepSeekR1ReasoningParser, R1_OPEN_PROMPT, "step</think>4", ("step", "4")),
]


@pytest.mark.parametrize("parser, prompt, text, expected", CASES)
def test_whole_texts(parser, prompt, text, expected):
    assert parser.parse(text, prompt) == expected


def feed_in_pieces(parser, text: str, rng: random.Random) -> tuple[list[str], list[str]]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
    reasoning, content = [], []
    for start, end in zip([0, *cuts], [*cuts, len(text)]):
        r, c = parser.feed(text[start:end])
        reasoning.append(r)
        content.append(c)
    r, c = parser.finish()
    return reasoning + [r], content + [c]


@pytest.mark.parametrize("parser, prompt, text, expected", CASES)
def test_any_split_adds_up_to_the_whole(parser, prompt, text, expected):
    rng = random.Random(text)
    for _ in range(50):
        reasoning, content = feed_in_pieces(parser(prompt), text, rng)
        assert ("".join(reasoning) or None, "".join(content) or None) == expected


def test_one_character_at_a_time_streams_as_soon_as_it_is_certain():
    """Only a possible marker is held back: the thinking streams while it is written."""
    parser = Qwen3ReasoningParser("")
    sent = [parser.feed(ch) for ch in "<think>abc</think>d"]
    assert sent[:7] == [("", "")] * 7                      # the opening marker, held then dropped
    assert [r for r, _ in sent[7:10]] == ["a", "b", "c"]   # thinking as it comes
    assert sent[10:18] == [("", "")] * 8                   # "</think>" held until certain
    assert sent[18] == ("", "d")


def test_held_prefix():
    assert held_prefix("abc</th", "</think>") == 4
    assert held_prefix("abc<", "</think>") == 1
    assert held_prefix("abc", "</think>") == 0
    assert held_prefix("</think>", "</think>") == 0      # a whole marker is found, not held


class CharTokenizer:
    """Token ids that are characters: the gate decodes the prompt to the prompt."""

    def decode(self, ids: list[str]) -> str:
        return "".join(ids)


@pytest.mark.parametrize("prompt", ["", "no markers", R1_CLOSED_PROMPT, R1_EMPTY_THOUGHT_PROMPT, R1_OPEN_PROMPT,
                                    "</think>", "<think>", "</think><think>", "<think></think>",
                                    "a</think>b<think>c</think>d"])
def test_deepseek_r1_opens_in_reasoning_exactly_where_the_engines_gate_is_open(prompt):
    """The engine constrains a structured output (a forced tool call's arguments, a JSON answer) once its
    ReasoningGate says the thinking ended, from the first token if the prompt ended it; the server must
    read that output as the answer, not as reasoning, or the answer lands in reasoning_content."""
    from nanovllm.config import REASONING_MARKERS
    from nanovllm.engine.structured_output import ReasoningGate
    gate = ReasoningGate(CharTokenizer(), *REASONING_MARKERS["deepseek_r1"], list(prompt))
    assert DeepSeekR1ReasoningParser(prompt).opens_in_reasoning(prompt) == (not gate.ended)


def test_registry_names_vllms_parsers():
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1"}
    assert reasoning_parser("qwen3") is Qwen3ReasoningParser
    with pytest.raises(ValueError, match="deepseek_r1"):
        reasoning_parser("granite")
