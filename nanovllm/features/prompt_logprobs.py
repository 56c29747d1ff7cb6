from dataclasses import dataclass

from nanovllm.features.processors import RequestProcessor


@dataclass
class PromptScoring:
    """Row rows[j] scores counts[j] prompt tokens from firsts[j]; the logits at step token
    indices[i] score targets[i]."""

    rows: list[int]
    firsts: list[int]
    counts: list[int]
    nums: list[int]
    indices: list[int]
    targets: list[int]

    @property
    def num(self) -> int:
        return max(self.nums)


class PromptLogprobs(RequestProcessor):
    """Reported once, when every prompt token is scored."""

    def __init__(self, seq, num: int):
        self.num = num
        self.entries: list[dict[int, float] | None] | None = [None]  # None for the first token
        seq.uses_prefix_cache = not self.scores_prompt(seq)

    def scores_prompt(self, seq) -> bool:
        return self.entries is not None and len(self.entries) < seq.num_prompt_tokens

    def contribute(self, step, row, seq, offset):
        if not step.is_prefill or not self.scores_prompt(seq):
            return
        computed, new = step.num_computed[row], step.num_new[row]
        start = max(computed, len(self.entries) - 1)  # the logits at p score token p + 1
        end = min(computed + new, seq.num_prompt_tokens - 1)
        if start >= end:
            return
        if step.prompt_scoring is None:
            step.prompt_scoring = PromptScoring([], [], [], [], [], [])
        s = step.prompt_scoring
        s.rows.append(row)
        s.firsts.append(start + 1)
        s.counts.append(end - start)
        s.nums.append(self.num)
        s.indices += range(offset + start - computed, offset + end - computed)
        s.targets += seq.token_ids[start + 1 : end + 1]

    def take(self, seq, extra):
        if "prompt_logprobs" in extra and self.entries is not None:
            first, entries = extra["prompt_logprobs"]
            self.entries += entries[len(self.entries) - first :]
            if not self.scores_prompt(seq):
                seq.uses_prefix_cache = True

    def report(self, seq, out, extra):
        if self.entries is not None and not self.scores_prompt(seq):
            out.prompt_logprobs, self.entries = self.entries, None  # reported once
