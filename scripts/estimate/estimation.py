"""Per-rank training memory without the GPUs: estimate one layout, plan layouts, or validate.

    python scripts/estimate/estimation.py --job.config_file train_configs/llama3_8b.toml \
        --memory_estimation.world_size 8 [--memory_estimation.device_memory_gib 80]
    ... --memory_estimation.mode plan --memory_estimation.device_memory_gib 80
    torchrun --nproc_per_node 2 scripts/estimate/estimation.py ... --memory_estimation.mode measure

See torchtitan/estimate/cli.py.
"""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from torchtitan.distributed.process import run_worker_entry_point  # noqa: E402
from torchtitan.estimate.cli import main  # noqa: E402

if __name__ == "__main__":
    run_worker_entry_point(main)
