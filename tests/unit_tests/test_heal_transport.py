"""Live healing's transport: a peer's state arrives as published (tensors, optimizer groups,
counters), a state whose unpickling would run code is refused in one line and never runs
(torchft's own HTTP transport runs it: the contrast the test shows), and the server listens
on the address it is given."""

from __future__ import annotations

import io
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from tests.crafted_checkpoints import Payload
from torchtitan.components.checkpointing.safe_loading import load_plain_state
from torchtitan.config.errors import UserInputError
from torchtitan.distributed.heal_transport import HealRefused, SafeHTTPTransport

TIMEOUT = timedelta(seconds=5)


@pytest.fixture
def peer():
    transport = SafeHTTPTransport("127.0.0.1", TIMEOUT, load_plain_state)
    yield transport
    transport.shutdown()


def test_a_published_state_arrives_as_sent(peer):
    state = {
        "user": {
            "model": {"layers.0.wq.weight": torch.randn(4, 3)},
            "optimizer": {
                "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
                "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "foreach": None}],
            },
            "train_state": {"step": 7, "name": "run"},
        },
        "torchft": {"step": 7, "batches_committed": 14},
    }
    peer.send_checkpoint([1], 7, state, TIMEOUT)
    assert peer.metadata().startswith("http://127.0.0.1:")
    received = peer.recv_checkpoint(0, peer.metadata(), 7, TIMEOUT)
    assert _same(received, state)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def test_a_step_nobody_published_is_one_line(peer):
    peer._timeout = timedelta(seconds=0.1)
    with pytest.raises(HealRefused, match=r"^fault_tolerance: cannot fetch the peer's state"):
        peer.recv_checkpoint(0, peer.metadata(), 3, TIMEOUT)


def _serve(peer: SafeHTTPTransport, step: int, payload: bytes) -> None:
    """Make ``peer`` serve raw ``payload`` for ``step`` (a malicious peer's server)."""
    with peer._published:
        peer._payload = (step, payload)
        peer._published.notify_all()


def test_a_state_that_would_run_code_is_refused_and_never_runs(peer, tmp_path):
    marker = tmp_path / "code-ran"
    buffer = io.BytesIO()
    torch.save({"user": Payload(marker)}, buffer)
    _serve(peer, 5, buffer.getvalue())
    with pytest.raises(HealRefused) as error:
        peer.recv_checkpoint(0, peer.metadata(), 5, TIMEOUT)
    message = str(error.value)
    assert "not plain tensors and data" in message and "\n" not in message, message
    assert not marker.exists()


def test_torchfts_own_transport_runs_such_a_state(peer, tmp_path):
    """The same malicious peer, in the wire format of torchft's HTTPTransport, which reads
    with weights_only=False: the payload runs (why healing does not use it)."""
    serialization = pytest.importorskip("torchft.checkpointing._serialization")
    from torchft.checkpointing import HTTPTransport

    marker = tmp_path / "code-ran"
    buffer = io.BytesIO()
    serialization._streaming_save({"user": Payload(marker)}, buffer)
    _serve(peer, 5, buffer.getvalue())
    HTTPTransport._load_from_address(f"{peer.metadata()}5", TIMEOUT)
    assert Path(marker).exists()


def test_an_address_this_host_does_not_have_is_one_line():
    with pytest.raises(UserInputError, match=r"^fault_tolerance.heal_address: cannot listen on"):
        SafeHTTPTransport("10.255.255.1", TIMEOUT, load_plain_state)
