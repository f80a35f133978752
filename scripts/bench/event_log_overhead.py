"""What the per-rank timeline (phase clock, straggler metrics, ``metrics.event_log``) costs per
training step, against the step time of the debug model on this machine.

    python scripts/bench/event_log_overhead.py [--steps 20000] [job-config options]

The timeline's cost is timed on its own, replaying the calls the trainer makes in one step
(the phase marks of every micro-batch, the event log's writes, the metrics at every
``metrics.log_freq``-th step) many times: a difference of two training runs would drown it
in the step-time noise of a CPU. The step time is the bare loop's (``bare_loop.py``) median
for the job config given (default: train_configs/debug_model.toml).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from scripts.bench import bare_loop  # noqa: E402
from torchtitan.components.rank_timeline import RankTimeline  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402

DEFAULT_CONFIG = ["--job.config_file", str(REPO_ROOT / "train_configs" / "debug_model.toml")]


def one_step(timeline: RankTimeline, step: int, micro_batches: int, log_freq: int) -> None:
    """The timeline calls of one trainer step, in the trainer's order."""
    timeline.step_started(step)
    timeline.set_phase("zero_grad")
    for _ in range(micro_batches):
        timeline.mark("data")
    timeline.mark("sync")
    for _ in range(micro_batches):
        timeline.start_microbatch()
        for phase in ("forward", "loss", "backward"):
            timeline.set_phase(phase)
    timeline.set_phase("clip_grad_norm")
    timeline.mark("sync")
    timeline.mark("checkpoint")
    timeline.set_phase("optimizer_step")
    if step % log_freq == 0:
        timeline.gather_metrics()
    timeline.mark("checkpoint")
    timeline.step_closed(step, True)


def timeline_seconds_per_step(steps: int, micro_batches: int, log_freq: int) -> float:
    with tempfile.TemporaryDirectory() as folder:
        timeline = RankTimeline(
            rank=0,
            world_size=1,
            device=torch.device("cpu"),
            event_log=Path(folder) / "rank-0.jsonl",
            threshold_pct=10.0,
            log_steps=3,
        )
        start = time.perf_counter()
        for step in range(1, steps + 1):
            one_step(timeline, step, micro_batches, log_freq)
        timeline.close()
        return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20000, help="replayed timeline steps")
    args, config_args = parser.parse_known_args(argv)
    job_config = ConfigManager().parse_args(DEFAULT_CONFIG + config_args)
    job_config.training.steps = min(job_config.training.steps, 20)
    bare = bare_loop.train(job_config, None)
    step_time = statistics.median(bare["step_times"][3:])
    micro_batches = max(job_config.training.global_batch_size, 1) // max(
        job_config.training.local_batch_size, 1
    )
    cost = timeline_seconds_per_step(args.steps, max(micro_batches, 1), job_config.metrics.log_freq)
    print(
        json.dumps(
            {
                "model": f"{job_config.model.name} {job_config.model.flavor}",
                "step_time_ms": round(1e3 * step_time, 2),
                "timeline_us_per_step": round(1e6 * cost, 2),
                "overhead_pct": round(100 * cost / step_time, 4),
            }
        )
    )


if __name__ == "__main__":
    main()
