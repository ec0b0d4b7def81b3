"""Running ``python -m jaxattn.serve`` as a subprocess: a free port to give it and the wait for its
``/health`` (the HTTP benchmark and the tests start servers this way)."""

from __future__ import annotations

import socket
import subprocess
import time

__all__ = ["free_port", "wait_healthy"]


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Returns once ``base_url``'s ``/health`` answers 200; RuntimeError if ``proc`` exits first,
    TimeoutError after ``timeout`` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it answered /health")
        try:
            if httpx.get(f"{base_url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the server did not answer /health within {timeout} s")
