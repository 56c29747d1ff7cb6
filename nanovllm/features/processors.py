from dataclasses import dataclass, field


@dataclass
class RowExtras:
    """Per-row sampling settings; None where no row has any."""

    num_rows: int
    suppressed: list | None = None  # token ids masked to -inf
    bias: list | None = None  # (token ids, values) added to the logits
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

    def add(self, kind: str, row: int, ids: list) -> None:
        """More ids for the row (suppressed ids from several processors)."""
        values = getattr(self, kind)
        before = [] if values is None or values[row] is None else values[row]
        self.set(kind, row, before + list(ids))

    def mask(self, row: int, bitmask) -> None:
        """A [1, words] int32 token bitmask for the row, and-ed with one it already has (over the
        narrower width: the ids past it are not allowed)."""
        if row in self.bitmask_rows:
            i = self.bitmask_rows.index(row)
            width = min(self.bitmasks[i].shape[1], bitmask.shape[1])
            self.bitmasks[i] = self.bitmasks[i][:, :width] & bitmask[:, :width]
        else:
            self.bitmask_rows.append(row)
            self.bitmasks.append(bitmask)


def row_extras(step) -> RowExtras:
    rows = step.sampling
    if rows.extra is None:
        rows.extra = RowExtras(len(rows.temperatures))
    return rows.extra


class RequestProcessor:
    """One sequence's hooks (docs/features.md), no-ops unless overridden."""

    def admit(self, seq) -> bool:
        return True  # False: the sequence may not start yet (it stays first in the queue)

    def contribute(self, step, row: int, seq, offset: int) -> None:
        pass

    def take(self, seq, extra: dict) -> None:
        pass

    def accept(self, seq, token_id: int) -> bool:
        return False  # True ends the sequence with "stop"

    def report(self, seq, out, extra: dict | None) -> None:
        pass
