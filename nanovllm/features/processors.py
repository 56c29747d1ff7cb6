"""Per-request processors: what a request needs beyond a temperature and a seed. They are picked
once, when the request is queued (``attach``); the core and the sampler call them without knowing
which exist. A plain request gets none: its steps carry only temperatures and draw seeds."""

from dataclasses import dataclass, field


@dataclass
class RowExtras:
    """A step's sampling settings beyond temperatures and seeds, one entry per row (None: the row
    has none of that kind; a list is None when no row has any). Plain data: it goes to rank 0."""

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
    """The step's ``RowExtras``, made by the first processor that contributes."""
    rows = step.sampling
    if rows.extra is None:
        rows.extra = RowExtras(len(rows.temperatures))
    return rows.extra


class RequestProcessor:
    """One sequence's hooks; each does nothing unless a processor overrides it."""

    def contribute(self, step, row: int, seq, offset: int) -> None:
        """Add to ``step`` (built for ``seq`` at ``row``; its tokens start at ``offset``)."""

    def take(self, seq, extra: dict) -> None:
        """The row's extra outputs of a resolved step (before its token is set)."""

    def accept(self, seq, token_id: int) -> bool:
        """The sampled token, just set; True ends the sequence with "stop"."""
        return False

    def report(self, seq, out, extra: dict | None) -> None:
        """Add to the ``SeqOutput`` the core reports for ``seq``."""
