"""Starting a live leanserve server on 127.0.0.1 for tests."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def is_error_event(line: str) -> bool:
    """Whether an SSE line is an error event: an object with an "error" key. (A substring test
    is not enough: the tiny random models generate the token "error" now and then.)"""
    return line.startswith("data: {") and "error" in json.loads(line[len("data: "):])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, model: str | None, *args: str, timeout: float = 180.0, log_path: str | None = None,
                 env: dict[str, str] | None = None):
        """``log_path``: where the server's log goes (default: a temporary file, removed at
        ``stop``); read it with ``log_text``. ``env``: added to this process's environment."""
        self.port = free_port()
        self._own_log = log_path is None
        if self._own_log:
            fd, log_path = tempfile.mkstemp(prefix="leanserve-test-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "leanserve.cli", "serve", *([model] if model else []), "--port", str(self.port),
               "--dtype", "float32", *args]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=None if env is None else os.environ | env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited during start-up with code {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError("server did not become healthy in time")

    def log_text(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def engine_pid(self) -> int:
        """The engine-core child process of a server with one engine."""
        (pid,) = self.engine_pids()
        return pid

    def engine_pids(self) -> list[int]:
        """The engine-core child processes (one per data-parallel engine), as the launcher logs them."""
        return self._logged_pids("engine-core processes")

    def api_pids(self) -> list[int]:
        """The API server child processes of a server with --api-server-count > 1."""
        return self._logged_pids("API server processes")

    def _logged_pids(self, what: str) -> list[int]:
        m = re.search(rf"{what}: pid (\d+(?:, \d+)*)", self.log_text())
        if m is None:
            raise RuntimeError(f"no '{what}' line in the server's log")
        return [int(p) for p in m.group(1).split(", ")]

    def stop(self, sig=signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if self._own_log and os.path.exists(self.log_path):
            os.remove(self.log_path)
        return self.proc.returncode


def write_chat_template(model_dir: str, template: str) -> None:
    import json

    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": template, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}, f)
