"""vLLM's ``cleanup_dist_env_and_memory``, called between two LLMs in one process."""

import gc
import sys


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """Collect garbage and return the CUDA cache's free blocks to the driver; with
    ``shutdown_ray``, shut Ray down. An LLM leaves its own process group at ``exit()``, so no
    group is destroyed here (one the program made itself stays)."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    ray = sys.modules.get("ray")
    if shutdown_ray and ray is not None and ray.is_initialized():
        ray.shutdown()
