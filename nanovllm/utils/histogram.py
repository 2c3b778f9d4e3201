"""Latency histograms with fixed buckets, as Prometheus reads them (cumulative counts per upper bound)."""
from bisect import bisect_left


class Histogram:
    def __init__(self, buckets: list[float]):
        self.buckets = sorted(buckets)
        self.counts = [0] * (len(self.buckets) + 1)     # the last: above every bound (+Inf)
        self.sum = 0.0
        self.count = 0

    @classmethod
    def latency(cls, shortest: float = 0.001, longest: float = 60.0) -> "Histogram":
        """Bounds of 1, 2.5 and 5 per decade from `shortest` up to `longest` seconds."""
        bounds, decade = [], shortest
        while decade <= longest:
            bounds.extend(round(b, 9) for b in (decade, 2.5 * decade, 5 * decade) if b <= longest)
            decade = round(decade * 10, 9)
        return cls(bounds)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> dict:
        """{"buckets": upper bounds, "counts": cumulative counts at each bound, "sum", "count"}."""
        cumulative, total = [], 0
        for n in self.counts[:-1]:
            total += n
            cumulative.append(total)
        return {"buckets": list(self.buckets), "counts": cumulative, "sum": self.sum, "count": self.count}
