"""``LLM.get_tokenizer()``: the Hugging Face tokenizer the engine encodes and decodes with."""


def get_tokenizer(llm):
    return llm.tokenizer
