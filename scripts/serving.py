"""Start and stop a real `vllm serve` on loopback (load test, server tests).

The server runs in its own process group, so stopping it also stops its engine
core and workers; its output goes to a log file whose tail explains a failed
start.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import requests

from vllm_selfspec.diagnostics import WORKER_EXTENSION


@dataclass
class Server:
    url: str
    process: subprocess.Popen | None  # None: started elsewhere
    log: Path | None

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def metric(self, name: str, scrape: str | None = None, **labels: str) -> float:
        """Sum of a Prometheus counter or gauge over its label sets that have
        `labels`, from `scrape` (a /metrics text) or a new scrape."""
        text = scrape if scrape is not None else requests.get(
            f"{self.url}/metrics", timeout=30).text
        found = re.findall(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? ([0-9.e+-]+)$",
                           text, flags=re.M)
        wanted = {f'{key}="{value}"' for key, value in labels.items()}
        return sum(float(value) for label_set, value in found
                   if wanted <= set(label_set.split(",")))

    def spec_counters(self, scrape: str | None = None) -> tuple[float, float, float]:
        """vLLM's draft-token, accepted-token and draft-round counters."""
        return tuple(self.metric(f"vllm:spec_decode_{name}_total", scrape)
                     for name in ("num_draft_tokens", "num_accepted_tokens", "num_drafts"))

    def collective_rpc(self, method: str) -> list:
        """A worker method on every rank (needs `dev_mode=True`)."""
        response = requests.post(f"{self.url}/collective_rpc", json={"method": method},
                                 timeout=60)
        response.raise_for_status()
        return response.json()["results"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def vllm_serve(model_dir: Path | str, spec: dict | None, log: Path, extra_args: list[str] = (),
               env: dict[str, str] | None = None, dev_mode: bool = False,
               start_timeout: float = 600) -> Iterator[Server]:
    """`vllm serve model_dir --speculative-config spec extra_args`, healthy,
    until the block ends. `dev_mode` adds vLLM's /collective_rpc endpoint and
    our worker methods (per-request state, counters)."""
    port = free_port()
    command = [str(Path(sys.executable).with_name("vllm")), "serve", str(model_dir),
               "--host", "127.0.0.1", "--port", str(port), *extra_args]
    if spec is not None:
        command += ["--speculative-config", json.dumps(spec)]
    environment = {**os.environ, **(env or {})}
    if dev_mode:
        command += ["--worker-extension-cls", WORKER_EXTENSION]
        environment["VLLM_SERVER_DEV_MODE"] = "1"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   env=environment, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", process, log)
    try:
        _wait_healthy(server, start_timeout)
        yield server
    finally:
        _stop(process)


def _wait_healthy(server: Server, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"vllm serve exited ({server.process.returncode}):\n"
                               f"{server.log_tail()}")
        try:
            if requests.get(f"{server.url}/health", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(2)
    raise RuntimeError(f"vllm serve was not healthy after {timeout:.0f} s:\n"
                       f"{server.log_tail()}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # workers left behind by the server
