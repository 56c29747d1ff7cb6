# vLLM's module paths (``vllm.v1.metrics.reader``) under this package's name
