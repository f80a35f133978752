"""The per-rank phase clock, the straggler judgement and the timeline drawing, in one
process (the 4-process plant is in tests/integration_tests/test_hangs_and_stragglers.py)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from scripts import timeline as timeline_script
from torchtitan.components.rank_timeline import PHASES, RankTimeline


def make_timeline(tmp_path, **kwargs) -> RankTimeline:
    options = dict(
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
        event_log=tmp_path / "events" / "rank-0.jsonl",
        threshold_pct=10.0,
        log_steps=2,
    )
    return RankTimeline(**{**options, **kwargs})


def run_step(timeline: RankTimeline, step: int, data_seconds: float) -> None:
    timeline.step_started(step)
    timeline.set_phase("zero_grad")
    timeline.mark("data")
    time.sleep(data_seconds)
    timeline.mark("sync")
    for phase in ("forward", "loss", "backward", "clip_grad_norm"):
        timeline.set_phase(phase)
    timeline.mark("sync")
    timeline.set_phase("optimizer_step")
    timeline.mark("checkpoint")
    timeline.step_closed(step, True)


def test_phases_of_the_completed_steps_reach_the_metrics_and_the_event_log(tmp_path):
    timeline = make_timeline(tmp_path)
    assert timeline.gather_metrics() == {}  # nothing completed yet
    run_step(timeline, 1, 0.02)
    run_step(timeline, 2, 0.02)
    metrics = timeline.gather_metrics()
    assert set(metrics) == {f"phase_time/{p}" for p in PHASES} | {
        "slowest_rank",
        "slowest_rank_excess_pct",
    }
    assert 0.02 <= metrics["phase_time/data"] < 0.2
    assert metrics["slowest_rank"] == 0 and metrics["slowest_rank_excess_pct"] == 0
    run_step(timeline, 3, 0.0)
    timeline.close()  # writes the steps after the last log step
    events = [json.loads(line) for line in (tmp_path / "events" / "rank-0.jsonl").open()]
    assert [e["phase"] for e in events if e["step"] == 1] == [
        "optimizer",
        "data",
        "sync",
        "forward_backward",
        "clip_grad_norm",
        "sync",
        "optimizer",
        "checkpoint",
    ]
    assert {e["step"] for e in events} == {1, 2, 3}
    ends = [e["start"] + e["duration"] for e in events]
    assert all(b["start"] == pytest.approx(a) for a, b in zip(ends, events[1:], strict=False))


def rows(data_by_rank: list[float], step: float = 1.0) -> list[list[float]]:
    """Per-rank seconds per phase: ``data`` as given, the rest of the step in forward_backward."""
    table = []
    for data in data_by_rank:
        row = [0.0] * len(PHASES)
        row[PHASES.index("data")] = data
        row[PHASES.index("forward_backward")] = step - data
        table.append(row)
    return table


def test_a_rank_slowest_for_log_steps_in_a_row_is_warned_about_once(tmp_path, caplog):
    timeline = make_timeline(tmp_path, world_size=4, event_log=None, hosts=["a", "b", "c", "d"])
    with caplog.at_level("WARNING"):
        first = timeline._judge(rows([0.0, 0.0, 0.3, 0.0]))
        assert first["slowest_rank"] == 2 and first["slowest_rank_excess_pct"] == pytest.approx(30)
        assert "straggler" not in caplog.text  # one log step is not persistent
        timeline._judge(rows([0.0, 0.0, 0.3, 0.0]))
        timeline._judge(rows([0.0, 0.0, 0.3, 0.0]))
    warnings = [r.message for r in caplog.records if "straggler" in r.message]
    assert warnings == [
        "straggler: rank 2 (c) has been the slowest rank for 2 log steps, 30% of a step slower "
        "than the median rank, in data (0.300 s per step, median rank 0.000 s)"
    ]


def test_below_the_threshold_or_a_changing_rank_is_no_straggler(tmp_path, caplog):
    timeline = make_timeline(tmp_path, world_size=4, event_log=None)
    with caplog.at_level("WARNING"):
        for table in (
            rows([0.0, 0.0, 0.09, 0.0]),  # 9 % < 10 %
            rows([0.0, 0.0, 0.09, 0.0]),
            rows([0.3, 0.0, 0.0, 0.0]),
            rows([0.0, 0.3, 0.0, 0.0]),  # another rank each time
            rows([0.0, 0.0, 0.3, 0.0]),
        ):
            timeline._judge(table)
    assert "straggler" not in caplog.text


def test_the_planted_straggler_waits_its_share_of_the_step_before_it(tmp_path):
    debug = SimpleNamespace(straggler_rank=0, straggler_slowdown=0.5, straggler_from_step=3)
    timeline = make_timeline(tmp_path, event_log=None)
    for step in (1, 2):
        run_step(timeline, step, 0.04)
        assert timeline.planted_delay(debug) == 0.0
    base = timeline.median_step_seconds()
    timeline.step_started(3)
    assert timeline.planted_delay(debug) == pytest.approx(0.5 * base)
    other_rank = make_timeline(tmp_path, rank=1, event_log=None)
    other_rank.step_started(3)
    assert other_rank.planted_delay(debug) == 0.0


def test_timeline_script_draws_each_lane_and_marks_the_slow_rank(tmp_path, capsys):
    events = tmp_path / "events"
    events.mkdir()
    for rank in range(3):
        data = 0.4 if rank == 1 else 0.01
        lines = []
        for step in (1, 2):
            start = 100.0 + step
            lines.append({"step": step, "phase": "data", "start": start, "duration": data})
            lines.append(
                {"step": step, "phase": "forward_backward", "start": start + data, "duration": 0.5}
            )
        (events / f"rank-{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert timeline_script.main([str(events), "--out", str(tmp_path / "t"), "--steps", "2:2"]) == 0
    out = capsys.readouterr().out
    ranks = [line for line in out.splitlines() if line.startswith("rank")]
    assert ["data   0.400*" in line for line in ranks] == [False, True, False]
    assert (tmp_path / "t.html").read_text().count("<rect") == 3 * 2
    assert (tmp_path / "t.png").read_bytes().startswith(b"\x89PNG")
    assert timeline_script.main([str(events), "--steps", "9:9"]) == 2
    assert "no events" in capsys.readouterr().err
