"""Per-request sampling settings (pure Python: imported by the engine core)."""
from dataclasses import dataclass


@dataclass
class SamplingParams:
    """How one request is sampled.

    temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / temperature).
    max_tokens: most completion tokens to generate (the request also stops at EOS or max_model_len).
    ignore_eos: keep generating past the end-of-sequence token.
    """

    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise TypeError(f"SamplingParams.temperature must be a number, got {t!r} ({type(t).__name__})")
        if not t >= 0 or t == float("inf"):  # also rejects NaN
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        self.temperature = float(t)
        m = self.max_tokens
        if isinstance(m, bool) or not isinstance(m, int):
            raise TypeError(f"SamplingParams.max_tokens must be an int, got {m!r} ({type(m).__name__})")
        if m < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {m}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
