"""The checkpoint transport of live healing (torchft): a group behind the others fetches a
live peer's state over HTTP, and nothing it receives can run code.

torchft's own ``HTTPTransport`` unpickles whatever a peer sends, so whoever can reach its
port can run code on a rejoining group. Here the state travels as ``torch.save`` bytes and
is decoded by the ``decode`` it is given: the trainer gives ``safe_loading.load_plain_state``
(torch's allow-list unpickler: tensors, containers, numbers, strings; the rule applied to
DCP's byte records), which raises a UserInputError for anything else. The server
listens only on the address the user names
(``fault_tolerance.heal_address``). Written here because torchft offers no transport with
either property.
"""

from __future__ import annotations

import io
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from torch.utils._pytree import tree_map

from torchtitan.config.errors import UserInputError

PATH_PREFIX = "/checkpoint/"


class HealRefused(UserInputError):
    """A peer's state that is not plain tensors and data (one line, naming the peer)."""


class SafeHTTPTransport:
    """torchft ``CheckpointTransport``: ``send_checkpoint`` publishes this group's state for
    a step, peers ``recv_checkpoint`` it from ``metadata()``'s URL."""

    def __init__(
        self, address: str, timeout: timedelta, decode: Callable[[bytes, str], Any]
    ) -> None:
        self._timeout = timeout
        self._decode = decode
        self._payload: tuple[int, bytes] | None = None
        self._published = threading.Condition()
        try:
            self._server = ThreadingHTTPServer((address, 0), _handler_for(self))
        except OSError as e:
            raise UserInputError(
                f"fault_tolerance.heal_address: cannot listen on {address!r} ({e.strerror}); "
                "name this host or one of its addresses"
            ) from None
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def metadata(self) -> str:
        host, port = self._server.server_address[:2]
        if host in ("", "0.0.0.0", "::"):
            host = socket.gethostname()
        return f"http://{host}:{port}{PATH_PREFIX}"

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta
    ) -> None:
        buffer = io.BytesIO()
        torch.save(tree_map(_on_cpu, state_dict), buffer)
        with self._published:
            self._payload = (step, buffer.getvalue())
            self._published.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._published:
            self._payload = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        url = f"{metadata}{step}"
        try:
            with urllib.request.urlopen(url, timeout=timeout.total_seconds()) as response:
                data = response.read()
        except (urllib.error.URLError, OSError) as e:
            raise HealRefused(
                f"fault_tolerance: cannot fetch the peer's state from {url}: {e}"
            ) from None
        try:
            return self._decode(data, f"the state from {url}")
        except UserInputError as e:
            raise HealRefused(f"fault_tolerance: {e}; refused, nothing of it ran") from None

    def payload_for(self, step: int) -> bytes | None:
        """The published bytes of ``step``, waiting up to the timeout for them."""
        with self._published:
            self._published.wait_for(
                lambda: self._payload is not None and self._payload[0] == step,
                timeout=self._timeout.total_seconds(),
            )
            if self._payload is None or self._payload[0] != step:
                return None
            return self._payload[1]

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join()


def _on_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def _handler_for(transport: SafeHTTPTransport) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            step = self.path.removeprefix(PATH_PREFIX)
            payload = transport.payload_for(int(step)) if step.isdigit() else None
            if payload is None:
                self.send_error(404, f"no state published for {self.path}")
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per request would flood the training log

    return Handler
