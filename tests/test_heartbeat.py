"""The progress line a run without a progress bar logs every few minutes (blade_core/heartbeat.py).

The clock is a counter the test advances: what is asserted is which steps get a line, and how a line reads for
given figures, never how long anything took."""

from __future__ import annotations

from blade_core.heartbeat import Heartbeat, duration, progress_line


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_line_at_most_once_per_interval_counted_from_the_last_line():
    clock, lines = Clock(), []
    beat = Heartbeat(lines.append, "blade forget05 seed 42", 250, every_s=300, clock=clock)
    for step in range(1, 11):  # one step per 100 ticks: a line on steps 3, 6 and 9
        clock.now += 100
        beat.beat(step)
    assert [line.split(": step ")[1].split(" of ")[0] for line in lines] == ["3", "6", "9"]
    assert all(line.startswith("blade forget05 seed 42: step ") and " of 250 " in line for line in lines)


def test_a_total_given_with_a_step_replaces_an_unknown_one():
    clock, lines = Clock(), []
    beat = Heartbeat(lines.append, "npo seed 42", None, every_s=0, clock=clock)
    beat.beat(3)
    beat.beat(4, total=20)  # a baseline's schedule arrives with its step records
    assert " of " not in lines[0] and " of 20 " in lines[1]


def test_the_line_gives_the_time_left_at_the_pace_so_far():
    assert (
        progress_line("blade forget05 seed 42", 120, 250, elapsed_s=450)
        == "blade forget05 seed 42: step 120 of 250 after 7.5 min, 8.1 min more at this pace"
    )
    last = progress_line("blade seed 42", 250, 250, elapsed_s=600)
    assert last == "blade seed 42: step 250 of 250 after 10.0 min"
    assert progress_line("pretraining", 3, None, elapsed_s=30) == "pretraining: step 3 after 30 s"


def test_durations_read_as_seconds_minutes_or_hours():
    assert [duration(s) for s in (0, 89, 90, 5399, 5400)] == ["0 s", "89 s", "1.5 min", "90.0 min", "1.5 h"]
