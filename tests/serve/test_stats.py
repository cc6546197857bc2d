"""The service's counters without Serve: counted per replica, summed on read."""

from __future__ import annotations

from fp8ray.serve.stats import COUNTS, RESEND_S, ReplicaCounts, ServiceStats


def test_a_replica_reports_only_what_changed_and_a_lost_report_is_made_good():
    counts = ReplicaCounts()
    assert counts.unreported() is None  # nothing counted: nothing to report
    counts.add(requests=2, bytes_in=10)
    first = counts.unreported()
    assert first == {**dict.fromkeys(COUNTS, 0), "requests": 2, "bytes_in": 10}
    # That report was lost (never marked reported): the next one carries it, as totals.
    counts.add(requests=1, errors=1)
    second = counts.unreported()
    assert (second["requests"], second["bytes_in"], second["errors"]) == (3, 10, 1)
    counts.reported(second)
    assert counts.unreported() is None
    counts.add(retries=1)
    assert counts.unreported()["retries"] == 1


def test_unchanged_totals_are_sent_again_for_a_stats_actor_recreated_empty():
    counts = ReplicaCounts()
    counts.add(requests=4)
    counts.reported(counts.unreported(now=100.0), now=100.0)
    assert counts.unreported(now=100.0 + RESEND_S / 2) is None
    assert counts.unreported(now=100.0 + RESEND_S)["requests"] == 4


def test_the_stats_actor_sums_the_latest_totals_of_each_replica():
    stats = ServiceStats()
    stats.report("a", {**dict.fromkeys(COUNTS, 0), "requests": 5, "bytes_out": 7})
    stats.report("b", {**dict.fromkeys(COUNTS, 0), "requests": 1})
    stats.report("a", {**dict.fromkeys(COUNTS, 0), "requests": 6, "bytes_out": 9})  # a's newer totals replace its older
    assert stats.snapshot() == {**dict.fromkeys(COUNTS, 0), "requests": 7, "bytes_out": 9}
    assert stats.report_count() == 3


def test_a_stop_waits_for_each_replica_to_hear_of_it_and_finish_its_requests():
    """The stats actor tells the replicas of a stop as they poll it; :meth:`drain` counts
    what is left: requests in flight, and one for a replica not yet told (it may be
    taking requests still). A replica silent for GONE_S has stopped: not waited for."""
    from fp8ray.serve.stats import GONE_S

    stats = ServiceStats()
    assert stats.poll("a", 2, now=0.0) is False and stats.poll("b", 0, now=0.0) is False
    assert stats.poll("gone", 5, now=-GONE_S) is False
    assert stats.drain(now=0.5) == 2 + 1  # a's two requests; b not yet told
    assert stats.poll("a", 1, now=1.0) is True and stats.poll("b", 0, now=1.0) is True
    assert stats.drain(now=1.0) == 1
    stats.poll("a", 0, now=2.0)
    assert stats.drain(now=2.0) == 0
