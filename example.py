"""Chat with a Qwen3 model through nano-vllm.

python example.py   # ~/huggingface/Qwen3-0.6B if present, else a tiny random model
python example.py --model /path/to/Qwen3-0.6B
python example.py --data-parallel-size 2                              # two replicas (processes)
python example.py --data-parallel-size 2 --data-parallel-backend ray  # two Ray actors ([ray] extra)
"""

import argparse
import os
import tempfile
from dataclasses import replace

from nanovllm import LLM

DEFAULT_MODEL = os.path.expanduser("~/huggingface/Qwen3-0.6B")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help=f"local Hugging Face model folder (default: {DEFAULT_MODEL})"
    )
    parser.add_argument(
        "--max-tokens", type=positive_int, default=256, help="most tokens per answer (>= 1)"
    )
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--data-parallel-size", type=positive_int, default=1, help="engine replicas (>= 1)"
    )
    parser.add_argument(
        "--data-parallel-backend",
        choices=("mp", "ray"),
        default="mp",
        help="replicas in processes of this host (mp) or in Ray actors (ray)",
    )
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()

    path = args.model or DEFAULT_MODEL
    tmp = None
    if args.model is None and not os.path.isdir(path):
        from nanovllm.utils.checkpoint import make_random_checkpoint

        tmp = tempfile.TemporaryDirectory(prefix="nanovllm-tiny-")
        path = make_random_checkpoint(tmp.name, "tiny")
        print(
            f"{DEFAULT_MODEL} not found: using a tiny Qwen3 with RANDOM weights at {path}.\n"
            "Its text is gibberish; the pipeline (chat template, batching, decoding) is the "
            "real one.\n"
        )

    with LLM(
        path,
        enforce_eager=args.enforce_eager,
        max_model_len=1024,
        data_parallel_size=args.data_parallel_size,
        data_parallel_backend=args.data_parallel_backend,
    ) as llm:
        # the model folder's generation_config.json (Qwen3: temperature 0.6, top_p 0.95, top_k 20)
        sampling_params = replace(llm.get_default_sampling_params(), max_tokens=args.max_tokens)
        conversations = [
            [{"role": "user", "content": "introduce yourself"}],
            [{"role": "user", "content": "list all prime numbers within 100"}],
        ]
        outputs = llm.chat(
            conversations, sampling_params, chat_template_kwargs={"enable_thinking": False}
        )
        for conversation, output in zip(conversations, outputs):
            print(
                f"\nUser: {conversation[0]['content']!r}\n"
                f"Assistant: {output['text']!r} ({output['finish_reason']})"
            )
        if args.data_parallel_size > 1:
            print(
                "\ngeneration tokens per replica:",
                [r["generation_tokens"] for r in llm.get_stats()["replicas"]],
            )

        # the same as a stream: text arrives token by token, never half a character
        print("\nUser: 'what is a paged KV cache?'\nAssistant (streamed): ", end="", flush=True)
        question = [{"role": "user", "content": "what is a paged KV cache?"}]
        prompt = llm.tokenizer.apply_chat_template(
            question, add_generation_prompt=True, enable_thinking=False, tokenize=False
        )
        for increment in llm.stream([prompt], sampling_params):
            print(increment["text"], end="", flush=True)
        print()
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
