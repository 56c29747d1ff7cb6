"""Chat with a Qwen3 model through nano-vllm.

    python example.py                      # ~/huggingface/Qwen3-0.6B if present, else a tiny random model
    python example.py --model /path/to/Qwen3-0.6B
"""
import argparse
import os
import tempfile

from nanovllm import LLM, SamplingParams

DEFAULT_MODEL = os.path.expanduser("~/huggingface/Qwen3-0.6B")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help=f"local Hugging Face model folder (default: {DEFAULT_MODEL})")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    args = parser.parse_args()

    path = args.model or DEFAULT_MODEL
    tmp = None
    if args.model is None and not os.path.isdir(path):
        from nanovllm.utils.checkpoint import make_random_checkpoint

        tmp = tempfile.TemporaryDirectory(prefix="nanovllm-tiny-")
        path = make_random_checkpoint(tmp.name, "tiny")
        print(f"{DEFAULT_MODEL} not found: using a tiny Qwen3 with RANDOM weights at {path}.\n"
              "Its text is gibberish; the pipeline (chat template, batching, decoding) is the real one.\n")

    # a small block size lets the tiny model run on the CPU too; flash-attn needs multiples of 256
    with LLM(path, enforce_eager=args.enforce_eager, max_model_len=1024, kvcache_block_size=256) as llm:
        sampling_params = SamplingParams(temperature=0.6, max_tokens=args.max_tokens)
        prompts = ["introduce yourself", "list all prime numbers within 100"]
        prompts = [
            llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            for prompt in prompts
        ]
        outputs = llm.generate(prompts, sampling_params)
        for prompt, output in zip(prompts, outputs):
            print(f"\nPrompt: {prompt!r}\nCompletion: {output['text']!r}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
