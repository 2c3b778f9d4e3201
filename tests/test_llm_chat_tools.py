"""LLM.chat and LLM.chat_prompt take `tools` and `chat_template_kwargs` to the chat template, and
conversations with tool calls and tool answers (the next turn of a tool-using chat)."""
import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.engine.chat_template import render_chat

pytestmark = pytest.mark.cpu_only     # every engine is device="cpu"

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
TEMPLATE = ("{% for m in messages %}{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}"
            "{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %};{% endfor %}"
            "{% for t in tools or [] %}<{{ t.function.name }}>{% endfor %}{{ 'no-think' if enable_thinking is "
            "sameas false else '' }}{% if add_generation_prompt %}assistant:{% endif %}")
TURNS = [{"role": "user", "content": "Weather?"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tiny(tiny_model):
    with LLM(str(tiny_model), device="cpu", kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=40) as llm:
        llm.tokenizer.chat_template = TEMPLATE
        yield llm


def test_chat_renders_tools_and_template_kwargs(tiny):
    ids = tiny.chat_prompt(TURNS, tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    assert tiny.tokenizer.decode(ids) == ('user:Weather?;assistant:get_weather{"city": "Oslo"};tool:sunny;'
                                          '<get_weather>no-thinkassistant:')
    assert ids == render_chat(tiny.tokenizer, tiny.config.model, TURNS, True, TOOLS, {"enable_thinking": False})
    [out] = tiny.chat(TURNS, GREEDY, use_tqdm=False, tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    assert out["prompt_token_ids"] == ids
    [plain] = tiny.chat(TURNS, GREEDY, use_tqdm=False)          # without them, the template sees neither
    assert tiny.tokenizer.decode(plain["prompt_token_ids"]).endswith(";tool:sunny;assistant:")
