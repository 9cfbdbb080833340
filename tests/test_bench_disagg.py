"""``leanserve bench disagg``'s reading of a decode worker's iteration rows, on made-up rows:
the segments it pools, the iterations it keeps, and why it alternates them (the decoders'
contexts grow through a run, and the step with them)."""

from __future__ import annotations

import numpy as np
import pytest

from leanserve.bench.disagg import CONTROL, DURING, QUIET, Segment, summarize_segments
from leanserve.engine.stats import FIELDS

DECODERS = 64
F = {name: i for i, name in enumerate(FIELDS)}


def rows_for(segments: list[Segment], step_ms, first: int = 1000) -> np.ndarray:
    """One row per iteration, iteration i begun at time i, from ``first`` to the last segment's
    end: the decoders' rows alone, host step ``step_ms(i, kind)`` where kind is the segment's
    (None between them)."""
    end = int(segments[-1].end)
    rows = np.zeros((end - first, len(FIELDS)))
    rows[:, F["num_generation_requests"]] = DECODERS
    for i in range(first, end):
        kind = next((s.kind for s in segments if s.start <= i < s.end), None)
        rows[i - first, F["start_time_s"]] = i
        rows[i - first, F["host_step_ms"]] = step_ms(i, kind)
        rows[i - first, F["schedule_ms"]] = 0.1
    return rows


def interleaved(rounds: int = 4, length: int = 200, gap: int = 10, first: int = 1000) -> list[Segment]:
    """The benchmark's order: quiet, then control and during (swapped every other round), a last
    quiet; ``gap`` between two segments (the client's own work between them)."""
    segments, t = [], first
    for r in range(rounds + 1):
        kinds = [QUIET] + ([] if r == rounds else [CONTROL, DURING] if r % 2 == 0 else [DURING, CONTROL])
        for kind in kinds:
            segments.append(Segment(kind, r, t, t + length))
            t += length + gap
    return segments


def drift(i: int) -> float:
    """The step grows with the decoders' contexts: 11 ms at the start, ~2.4x by the end."""
    return 11.0 + 0.01 * (i - 1000)


@pytest.mark.parametrize("rounds", [1, 3, 4])
def test_each_stream_against_the_quiet_level_where_it_ran_cancels_the_drift(rounds):
    segments = interleaved(rounds)
    rows = rows_for(segments, lambda i, kind: drift(i))  # the stream costs nothing
    r = summarize_segments(rows, segments, DECODERS)["ratios"]["host_step_ms"]
    for name in ("p99 during / quiet", "p99 control / quiet", "p99 during / control"):
        assert np.allclose(r[name]["by_round"], 1.0, atol=0.01), (name, r[name])
    # One quiet window before the stream against the whole stream reads the drift, not the stream.
    host = rows[:, F["host_step_ms"]]
    during = np.concatenate([host[s.start - 1000 : s.end - 1000] for s in segments if s.kind == DURING])
    assert np.percentile(during, 99) / np.percentile(host[: segments[0].end - 1000], 99) > 1.2


def test_a_stream_that_slows_the_step_shows_in_every_round():
    segments = interleaved()
    rows = rows_for(segments, lambda i, kind: drift(i) * (1.5 if kind == DURING else 1.0))
    r = summarize_segments(rows, segments, DECODERS)["ratios"]["host_step_ms"]
    assert np.allclose(r["p99 during / quiet"]["by_round"], 1.5, atol=0.02)
    assert np.allclose(r["p99 during / control"]["by_round"], 1.5, atol=0.02)
    assert np.allclose(r["p99 control / quiet"]["by_round"], 1.0, atol=0.01)


def test_a_stream_without_iterations_is_left_out_of_the_median():
    segments = interleaved(rounds=2)
    rows = rows_for(segments, lambda i, kind: drift(i) * (1.5 if kind == DURING else 1.0))
    empty = next(s for s in segments if s.kind == DURING)
    segments[segments.index(empty)] = Segment(DURING, empty.round, empty.start, empty.start)  # too short to hold one
    r = summarize_segments(rows, segments, DECODERS)["ratios"]["host_step_ms"]["p99 during / quiet"]
    assert r["by_round"][0] is None and r["median"] == pytest.approx(1.5, abs=0.02)


def test_only_the_decoders_own_iterations_count_for_the_host_step_and_arrivals_are_split_out():
    segments = interleaved(rounds=1, length=100)
    rows = rows_for(segments, lambda i, kind: 10.0)
    during = next(s for s in segments if s.kind == DURING)
    at = during.start - 1000
    rows[at + 10, F["num_generation_requests"]] = DECODERS + 1  # a received request's row beside them
    rows[at + 10, F["host_step_ms"]] = 500.0  # its 32k-token context: the forward's cost, not the host's
    rows[at + 20, F["num_context_tokens"]] = 64  # a prefill chunk
    rows[at + 20, F["host_step_ms"]] = 500.0
    rows[at + 31, F["num_new_requests"]] = 1  # iteration at + 30 ran beside that request's enqueue
    rows[at + 30, F["host_step_ms"]] = 14.0
    rows[at + 40, F["num_waiting_for_kv"]] = 1
    out = summarize_segments(rows, segments, DECODERS)
    host = out["host_step_ms"]
    assert host["during"]["n"] == 98 and host["during"]["max"] == 14.0
    assert host["during, before an arrival"]["n"] == 1 and host["during, before an arrival"]["p50"] == 14.0
    assert host["during, the others"]["n"] == 97
    assert host["during, transfers pending"]["n"] == 1 and host["during, none pending"]["n"] == 97
    assert out["ratios"]["host_step_ms"]["p50 before an arrival / the others"] == pytest.approx(1.4)
    assert host["during, with received rows"]["n"] == 1 and host["during, with received rows"]["p50"] == 500.0
    assert out["loop_work_ms"]["during"]["n"] == 99  # the loop's own work counts every decode iteration
