"""The progress line a run without a progress bar logs every few minutes (blade_core/heartbeat.py)."""

from __future__ import annotations

from blade_core.heartbeat import Heartbeat, duration


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_line_at_most_every_interval_with_the_time_left_at_this_pace():
    clock, lines = Clock(), []
    beat = Heartbeat(lines.append, "blade forget05 seed 42", 250, every_s=300, clock=clock)
    clock.now += 299
    beat.beat(60)
    assert lines == []  # not yet five minutes
    clock.now += 1
    beat.beat(60)
    assert lines == ["blade forget05 seed 42: step 60 of 250 after 5m00s, 15m50s more at this pace"]
    clock.now += 100
    beat.beat(70)
    assert len(lines) == 1  # the interval counts from the last line
    clock.now += 200
    beat.beat(250)
    assert lines[-1] == "blade forget05 seed 42: step 250 of 250 after 10m00s"


def test_a_total_given_with_a_step_replaces_an_unknown_one():
    clock, lines = Clock(), []
    beat = Heartbeat(lines.append, "npo seed 42", None, every_s=10, clock=clock)
    clock.now += 10
    beat.beat(3)
    assert lines == ["npo seed 42: step 3 after 10s"]
    clock.now += 10
    beat.beat(4, total=20)  # a baseline's schedule arrives with its step records
    assert lines[-1] == "npo seed 42: step 4 of 20 after 20s, 1m20s more at this pace"


def test_durations_read_as_seconds_minutes_or_hours():
    assert [duration(s) for s in (0, 59.4, 61, 3599, 3600, 7500)] == [
        "0s",
        "59s",
        "1m01s",
        "59m59s",
        "1h00m",
        "2h05m",
    ]
