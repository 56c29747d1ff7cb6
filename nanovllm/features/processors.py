from dataclasses import dataclass, field


@dataclass
class RowExtras:
    """Per-row sampling settings; None where no row has any."""

    num_rows: int
    suppressed: list | None = None  # token ids masked to -inf
    penalties: list | None = None  # (repetition, presence, frequency, prompt ids, output ids)
    filters: list | None = None  # (top_k, top_p, min_p)
    logprobs: list | None = None  # top tokens to return
    bitmask_rows: list[int] = field(default_factory=list)  # rows a grammar constrains
    bitmasks: list = field(default_factory=list)  # their [1, words] int32 token bitmasks
    sync: bool = False  # the next step's rows need this step's tokens on the host

    def set(self, kind: str, row: int, value) -> None:
        values = getattr(self, kind)
        if values is None:
            values = [None] * self.num_rows
            setattr(self, kind, values)
        values[row] = value


def row_extras(step) -> RowExtras:
    rows = step.sampling
    if rows.extra is None:
        rows.extra = RowExtras(len(rows.temperatures))
    return rows.extra


class RequestProcessor:
    """One sequence's hooks (docs/features.md), no-ops unless overridden."""

    def contribute(self, step, row: int, seq, offset: int) -> None:
        pass

    def take(self, seq, extra: dict) -> None:
        pass

    def accept(self, seq, token_id: int) -> bool:
        return False  # True ends the sequence with "stop"

    def report(self, seq, out, extra: dict | None) -> None:
        pass
