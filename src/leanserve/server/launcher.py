"""The ``serve`` command's process: checks the flags, binds the listening socket, starts the
engine-core processes (``engine/launch.py``) and the API process(es), and stops them together.

* One API process (the default): it is this process, so a server is two processes as it always
  was (API + engine, or API + N engines with ``-dp N``).
* ``--api-server-count N`` (vLLM's flag): N spawned API processes inherit the one listening
  socket (the kernel gives each new connection to whichever process accepts first) and all
  reach the same engines, each engine sending its outputs to every one of them
  (``engine/endpoints.py``). Request metrics are summed across them through prometheus-client's
  multiprocess mode, in a private directory removed at exit (``server/metrics.py``).

Shutdown, SIGTERM or Ctrl-C: every API process drains as a single one does (in-flight requests
get ``--shutdown-timeout`` seconds, then end with "abort"), then the engines stop; status 0 when
every API process stopped cleanly. An API process that dies ends the whole server with a log line
naming it, as vLLM's launcher does. An engine that dies does not: every API process fails that
engine's requests the moment it exits (a pidfd; for an engine that is a Ray actor, a message from
this process as soon as Ray reports the death, ``engine/ray_engines.py``) and /health answers 503,
exactly as with one API process.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING

from ..engine.launch import EngineProcesses, engines_for
from ..engine.messages import MAX_CLIENTS
from .app import SEND_GRACE_S, ServerConfig, ServerPlan, load_tokenizer, run_api_server
from .metrics import MULTIPROC_DIR_ENV
from .sampling_defaults import sampling_defaults

if TYPE_CHECKING:  # the annotation only: a server without ray engines never loads the module
    from ..engine.ray_engines import RayEngines

log = logging.getLogger("leanserve.server")

BACKLOG = 2048  # uvicorn's default
PARENT_CHECK_S = 0.5  # how often an API process checks that the launcher is still there
STOP_MARGIN_S = 5.0  # beyond the drain and send grace, before a stuck API process is killed


def serve(cfg: ServerConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # Every flag is checked here, before any process starts: a bad one is a ValueError, one line
    # from cli.main.
    cfg.validate()
    resolved = cfg.engine.resolve()
    n = cfg.api_server_count
    if not 1 <= n <= MAX_CLIENTS:
        raise ValueError(f"api_server_count: must be in [1, {MAX_CLIENTS}], got {n}")
    path = resolved.model.path
    tokenizer = load_tokenizer(cfg, path)
    defaults = sampling_defaults(cfg.generation_config, path)
    engines = engines_for(resolved, list(tokenizer.eos_token_ids), cfg.data_parallel_size, n, cfg.watchdog_timeout)
    with listening_socket(cfg.host, cfg.port) as sock, engines:
        plan = ServerPlan(cfg, path, defaults, engines.start())
        if n == 1:
            run_api_server(plan, tokenizer, 0, sock)
        else:
            _run_api_processes(plan, sock, engines)


def listening_socket(host: str, port: int) -> socket.socket:
    """Bound before any process starts, so a port in use is one line at once rather than a failure
    after the model has loaded. As uvicorn binds: SO_REUSEADDR, IPv6 for a host with a colon."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(BACKLOG)
    return sock


def _run_api_processes(plan: ServerPlan, sock: socket.socket, engines: EngineProcesses | RayEngines) -> None:
    cfg = plan.config
    metrics_dir = tempfile.mkdtemp(prefix="leanserve-metrics-")
    os.environ[MULTIPROC_DIR_ENV] = metrics_dir  # prometheus-client in each API process reads it
    spawn = multiprocessing.get_context("spawn")
    api = [spawn.Process(target=_api_process, name=f"leanserve-api-{i}", daemon=True,
                         args=(plan, i, sock, os.getpid()))
           for i in range(cfg.api_server_count)]
    try:
        for p in api:
            p.start()
        # The API processes hold the socket now. Left open here, it would go on queueing
        # connections in the kernel after they have stopped accepting, never to be answered.
        sock.close()
        log.info("API server processes: pid %s", ", ".join(str(p.pid) for p in api))
        signum = _wait_for_stop(api, engines.procs)
        for p in api:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + cfg.shutdown_timeout + SEND_GRACE_S + STOP_MARGIN_S
        for p in api:
            p.join(max(0.0, deadline - time.monotonic()))
        unclean = [p for p in api if p.exitcode != 0]
    finally:
        for p in api:
            if p.is_alive():
                log.error("API server process %d did not stop in time: killing it", p.pid)
                p.kill()
                p.join()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        os.environ.pop(MULTIPROC_DIR_ENV)
    if signum is None or unclean:
        sys.exit(1)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt  # the status Ctrl-C gives a single API process too (130, from cli.main)


def _wait_for_stop(api: list[multiprocessing.Process], engines: list[multiprocessing.Process]) -> int | None:
    """Returns the signal that asked for a shutdown (SIGTERM, SIGINT), or None when an API
    process died."""
    wake_r, wake_w = socket.socketpair()
    wake_w.setblocking(False)
    # A signal only writes its number to wake_w, which wakes the wait below: no handler runs
    # in the middle of the shutdown that follows.
    old_fd = signal.set_wakeup_fd(wake_w.fileno())
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    watched = {p.sentinel: p for p in api + engines}
    try:
        while True:
            ready = multiprocessing.connection.wait([wake_r, *watched])
            if wake_r in ready:
                signum = wake_r.recv(1)[0]
                log.info("shutting down (%s)", signal.Signals(signum).name)
                return signum
            for sentinel in ready:
                p = watched.pop(sentinel)
                p.join()
                if p in engines:
                    log.error("engine-core process %d exited with code %s: every API process has failed its "
                              "requests; /health answers 503 until the server is restarted", p.pid, p.exitcode)
                else:
                    log.error("API server process %d exited with code %s: shutting the server down",
                              p.pid, p.exitcode)
                    return None
    finally:
        # One shutdown at a time: it is bounded (drain, send grace, margin), and a second SIGTERM
        # must not end this process before its children (a single API process ignores it too).
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        signal.set_wakeup_fd(old_fd)
        wake_r.close()
        wake_w.close()


def _api_process(plan: ServerPlan, index: int, sock: socket.socket, launcher_pid: int) -> None:
    """An API process of several: ``run_api_server``, with what being a child takes."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s api{index} %(name)s %(levelname)s %(message)s")
    # Ctrl-C reaches the whole process group; the launcher turns it into one SIGTERM for each.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_stop_without_parent, args=(launcher_pid,), daemon=True,
                     name="leanserve-parent-check").start()
    run_api_server(plan, load_tokenizer(plan.config, plan.model_path), index, sock)


def _stop_without_parent(launcher_pid: int) -> None:
    """A launcher killed outright leaves no one to stop this process: it drains and exits itself."""
    while os.getppid() == launcher_pid:
        time.sleep(PARENT_CHECK_S)
    os.kill(os.getpid(), signal.SIGTERM)
