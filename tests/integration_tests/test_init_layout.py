"""Every layout starts from exactly the 1-process weights (per-FQN initialisation)."""

import pytest

from tests.launcher import REPO_ROOT, run_torchrun

SCRIPT = REPO_ROOT / "tests" / "integration_tests" / "scripts" / "init_probe.py"
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


@pytest.mark.parametrize(
    "nproc, overrides",
    [
        (2, []),  # FSDP 2
        (2, ["--parallelism.tensor_parallel_degree", "2"]),
        (4, ["--parallelism.tensor_parallel_degree", "2"]),  # FSDP 2 x TP 2
        (2, ["--parallelism.pipeline_parallel_degree", "2"]),  # each pipeline stage
    ],
)
def test_full_tensors_equal_single_process_init(tmp_path, nproc, overrides):
    run_torchrun(nproc, overrides, script=str(SCRIPT), env={"OUT_DIR": str(tmp_path)}, timeout=170)
    results = {p.name: p.read_text() for p in tmp_path.glob("rank*.txt")}
    assert len(results) == nproc
    assert set(results.values()) == {"ok"}, results
