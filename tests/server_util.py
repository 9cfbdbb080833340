"""Starting a live leanserve server on 127.0.0.1 for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, model: str | None, *args: str, timeout: float = 180.0, log_path: str | None = None):
        """``log_path``: where the server's log goes (default: nowhere); read it with ``log_text``."""
        self.port = free_port()
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "leanserve.cli", "serve", *([model] if model else []), "--port", str(self.port),
               "--dtype", "float32", *args]
        self.log = open(log_path or os.devnull, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
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
        """The engine-core child processes (one per data-parallel engine)."""
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True, text=True)
        engines = []
        for pid in map(int, out.stdout.split()):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():  # not the resource tracker, also a child
                    engines.append(pid)
        if not engines:
            raise RuntimeError(f"no engine process among the children of {self.proc.pid}")
        return engines

    def stop(self, sig=signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def write_chat_template(model_dir: str, template: str) -> None:
    import json

    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": template, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}, f)
