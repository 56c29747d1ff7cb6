"""The metric objects ``LLM.get_metrics()`` returns, with vLLM's classes and fields."""

from dataclasses import dataclass


@dataclass
class Metric:
    """One metric of one engine: its name and labels (``model_name``, ``engine``, ...)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int  # only grows while the LLM runs


@dataclass
class Vector(Metric):
    values: list[int]  # counters in order


@dataclass
class Gauge(Metric):
    value: float  # may go up or down


@dataclass
class Histogram(Metric):
    """``buckets``: upper bound (a string, "+Inf" last) -> observations up to it, cumulative."""

    count: int
    sum: float
    buckets: dict[str, int]
