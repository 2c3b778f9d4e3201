"""The faces beyond LLM: the OpenAI-compatible server (`nanovllm serve`), the terminal chat
(`nanovllm chat`) and the `nanovllm` command that holds them. They reach the engine only through
`nanovllm.AsyncLLM`. The server needs the `serve` extra: `pip install -e ".[serve]"`."""
