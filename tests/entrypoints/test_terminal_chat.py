"""The terminal chat's parts in process: the local backend streams the engine's text piece by piece,
and the read-reply loop keeps the conversation, starts over on /reset and ends on /exit or end of input."""
import io

import pytest

from nanovllm.entrypoints.terminal_chat import ChatError, LocalChat, converse

pytestmark = [pytest.mark.cpu_only, pytest.mark.timeout(60)]     # a fake engine


class ScriptedBackend:
    """Answers "reply N" to the N-th turn and records the conversation each turn was sent."""

    def __init__(self, fail_on: str | None = None):
        self.seen: list[list[dict]] = []
        self.fail_on = fail_on

    def reply(self, messages, sampling, on_text):
        if messages[-1]["content"] == self.fail_on:
            raise ChatError("no")
        self.seen.append([dict(m) for m in messages])
        text = f"reply {len(self.seen)}"
        for word in text.split(" "):
            on_text(word + ("" if word[0].isdigit() else " "))
        return text


def run(backend, lines: list[str], system: str | None = None) -> str:
    script, out = iter(lines), io.StringIO()

    def read(prompt: str) -> str:
        out.write(prompt)
        try:
            return next(script)
        except StopIteration:
            raise EOFError from None
    converse(backend, {"temperature": 0.0}, system, read=read, out=out)
    return out.getvalue()


def test_conversation_history_reset_exit():
    backend = ScriptedBackend(fail_on="bad")
    out = run(backend, ["hello", "", "again", "bad", "/reset", "fresh", "/nope", "/exit", "never read"], system="sys")
    assert backend.seen == [
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}],
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"},
         {"role": "assistant", "content": "reply 1"}, {"role": "user", "content": "again"}],
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "fresh"}],     # "bad" was forgotten
    ]
    assert "reply 1\n" in out and "reply 2\n" in out and "error: no" in out and "unknown command /nope" in out


def test_end_of_input_quits():
    assert run(ScriptedBackend(), ["hi"]).endswith("> \n")


def test_local_backend_streams(fake_engine):
    chat = LocalChat(fake_engine)
    pieces = []
    try:
        text = chat.reply([{"role": "user", "content": "hi"}], {"max_tokens": 5, "temperature": 0.0}, pieces.append)
        assert text == "0: th" and pieces == ["0", ":", " ", "t", "h"]        # as the tokens come
        [params] = fake_engine.requests.values()
        assert params.temperature == 0.0 and params.top_p == 0.9      # the engine's defaults under the options
        with pytest.raises(ChatError):
            chat.reply([], {}, pieces.append)
    finally:
        chat.close()
    assert not fake_engine.is_running
