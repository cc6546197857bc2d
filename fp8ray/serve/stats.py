"""The service's counters: counted in each replica, summed on read (no Serve here).

A replica counts its own requests in a :class:`ReplicaCounts` (no call per request to
anything). Every ``REPORT_INTERVAL_S`` in which they changed, and before answering
``GET /v1/stats``, it reports their running totals to the :class:`ServiceStats` actor,
which keeps the latest totals of each replica and sums them when read. Totals, not
increments: a report that is lost is made good by the next one, and a replica that
dies keeps the counts of its last report. Unchanged totals are sent again every
``RESEND_S``, so that a stats actor recreated empty gets back an idle replica's counts.
"""

from __future__ import annotations

import time

# client_closed: requests whose client hung up before the answer (status 499), no error of the service's.
COUNTS = ("requests", "bytes_in", "bytes_out", "errors", "client_closed", "retries")
REPORT_INTERVAL_S = 1.0  # the most a replica's counts lag behind in another replica's /v1/stats
RESEND_S = 10.0  # unchanged totals are reported again this often
GONE_S = 3 * REPORT_INTERVAL_S  # a replica that has not polled for this long has stopped


class ReplicaCounts:
    """One replica's running totals, and those its last report carried."""

    def __init__(self):
        self.totals = dict.fromkeys(COUNTS, 0)
        self._reported = dict(self.totals)
        self._reported_at = time.monotonic()

    def add(self, **deltas: int) -> None:
        for name, value in deltas.items():
            self.totals[name] += value

    def unreported(self, now: float | None = None) -> dict[str, int] | None:
        """A copy of the totals to report, or ``None`` when the last report, less than
        :data:`RESEND_S` ago, holds them."""
        now = time.monotonic() if now is None else now
        changed = self.totals != self._reported
        return dict(self.totals) if changed or now - self._reported_at >= RESEND_S else None

    def reported(self, totals: dict[str, int], now: float | None = None) -> None:
        """``totals`` (from :meth:`unreported`) reached the stats actor."""
        self._reported = totals
        self._reported_at = time.monotonic() if now is None else now


class ServiceStats:
    """The latest totals each replica reported, summed on read (a deployment-scoped actor).
    ``reports`` counts the reports received: it grows with time, not with requests.

    It also tells the replicas of a stop: each polls it every ``REPORT_INTERVAL_S`` with
    its requests in flight (:meth:`poll`), and learns from the answer that the service is
    draining; :meth:`drain` starts that, and says how many requests are still in flight."""

    def __init__(self):
        self.by_replica: dict[str, dict[str, int]] = {}
        self.reports = 0
        self.draining = False
        # Each replica's last poll: when, its requests in flight, whether it knew of the stop.
        self.polls: dict[str, tuple[float, int, bool]] = {}

    def poll(self, replica: str, in_flight: int, now: float | None = None) -> bool:
        """A replica's requests in flight; answers whether the service is draining."""
        self.polls[replica] = (time.monotonic() if now is None else now, in_flight, self.draining)
        return self.draining

    def drain(self, now: float | None = None) -> int:
        """Start draining; returns the requests still in flight on the replicas that polled
        in the last ``GONE_S``, counting one for each that has not yet heard of it (0: done)."""
        self.draining = True
        now = time.monotonic() if now is None else now
        live = [(count, told) for at, count, told in self.polls.values() if now - at < GONE_S]
        return sum(count if told else max(count, 1) for count, told in live)

    def report(self, replica: str, totals: dict[str, int]) -> None:
        self.reports += 1
        self.by_replica[replica] = totals

    def snapshot(self) -> dict[str, int]:
        return {name: sum(t.get(name, 0) for t in self.by_replica.values()) for name in COUNTS}

    def report_count(self) -> int:
        return self.reports
