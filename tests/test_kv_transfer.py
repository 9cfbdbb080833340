"""KV transfer between two engines over the ZeroMQ connector, in one process (loopback TCP):
real bytes, real sockets, the tiny random model of ``leanserve bench host``. A prefill engine
leases a prompt's blocks; a decode engine pulls them into its own and decodes what a single
engine would have."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import zmq

from leanserve.bench.disagg import install_copy_bug
from leanserve.bench.host import tiny_model
from leanserve.engine.config import CPU_BLOCK_SIZE, EngineConfig
from leanserve.engine.core import EngineCore
from leanserve.engine.kv_transfer.config import KVTransferConfig
from leanserve.engine.kv_transfer.messages import RemotePrefill
from leanserve.engine.kv_transfer.zmq_connector import answer_frames, pieces
from leanserve.engine.messages import demux
from leanserve.engine.params import SamplingParams
from leanserve.engine.request import FinishReason

from .server_util import free_port

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def engine(role: str | None = "kv_both", seed: int = 0, dtype=torch.float32, engine_id: str | None = None,
           port: int | None = None, **kw) -> EngineCore:
    kv = None if role is None else KVTransferConfig(kv_role=role, kv_port=port or free_port(), engine_id=engine_id,
                                                    kv_transfer_timeout_s=kw.pop("timeout", 10.0)).with_engine_id()
    kw = dict(max_num_seqs=8, max_model_len=512, kv_cache_memory=4 << 20) | kw
    cfg = EngineConfig(kv_transfer=kv, dtype=str(dtype).removeprefix("torch."), **kw)
    return EngineCore(cfg, model=tiny_model(512, seed=seed).to(dtype))


@pytest.fixture
def engines():
    made = []

    def make(*args, **kw) -> EngineCore:
        made.append(engine(*args, **kw))
        return made[-1]

    yield make
    for core in made:
        core.close()


def run(core: EngineCore, request_ids, timeout: float = 60.0) -> dict[int, list]:
    """Steps ``core`` until every request in ``request_ids`` has finished; their events by id."""
    events = {rid: [] for rid in request_ids}
    deadline = time.monotonic() + timeout
    while any(not evs or evs[-1].finish_reason == FinishReason.NONE for evs in events.values()):
        assert time.monotonic() < deadline, "requests did not finish in time"
        out = core.step()
        if out is None:
            time.sleep(0.001)
            continue
        for rid, ev in demux(out):
            if rid in events:
                events[rid].append(ev)
    return events


def tokens(evs) -> list[int]:
    return [e.token_id for e in evs if e.token_id >= 0]


def prefill(core: EngineCore, rid: int, prompt: np.ndarray) -> RemotePrefill:
    """Runs a prefill for a decode worker; returns the params a decode worker gets."""
    core.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                     do_remote_decode=True)
    (last,) = [e for e in run(core, [rid])[rid] if e.finish_reason != FinishReason.NONE]
    assert last.finish_reason == FinishReason.LENGTH and last.kv_lease is not None
    lease, cfg = last.kv_lease, core.config.kv_transfer
    return RemotePrefill(cfg.engine_id, lease.request_id, lease.epoch, lease.block_ids, cfg.kv_ip, cfg.kv_port,
                         lease.num_cached_tokens)


def blocks_of(core: EngineCore, block_ids) -> np.ndarray:
    """A copy of these blocks' bytes, [layers * 2, len(block_ids), span_bytes]."""
    return core.kv.spans().numpy()[:, np.asarray(block_ids)].copy()


def prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 512, n).astype(np.int32)


@pytest.mark.parametrize("copy_threshold", [zmq.COPY_THRESHOLD, 0], ids=["pyzmq's", "every frame in place"])
def test_a_decode_engine_decodes_from_pulled_kv_what_one_engine_would(engines, copy_threshold, monkeypatch):
    """With pyzmq's copy threshold (64 kB) these short prompts' blocks are gathered; with none,
    every run of blocks is sent as the cache's own memory and tracked until ZeroMQ is done."""
    monkeypatch.setattr(zmq, "COPY_THRESHOLD", copy_threshold)  # read by each socket as it is made
    p, d, single = engines("kv_producer"), engines("kv_consumer"), engines(None)
    prompts = [prompt(n, seed=n) for n in (5, 16, 32, 50, 200)]  # 16, 32: whole blocks of either size
    for i, ids in enumerate(prompts):
        remote = prefill(p, 100 + i, ids)
        blocks = blocks_of(p, remote.block_ids)
        before = d.scheduler.prompt_tokens_total
        d.add_request(200 + i, ids, GREEDY, remote_prefill=remote)
        single.add_request(300 + i, ids, GREEDY)
        got, want = run(d, [200 + i])[200 + i], run(single, [300 + i])[300 + i]
        assert tokens(got) == tokens(want) and got[-1].finish_reason == FinishReason.LENGTH
        assert d.scheduler.prompt_tokens_total - before == 1  # only the last prompt token computed here
        # The decode engine's blocks hold the prefill engine's bytes: the full ones exactly (the
        # last is rewritten from its last prompt token on, by this engine's own decode rows).
        full = (len(ids) - 1) // d.kv.block_size
        received = blocks_of(d, d.scheduler.batch.block_table[0, :full])  # slot 0: the only one used
        assert np.array_equal(received, blocks[:, :full])
    p.step()  # pulled leases come back to the loop: their blocks are freed
    assert p.kv.pool.num_used == 0 and p.connector.leases.num_held == 0
    assert d.connector.counters.loads_completed == len(prompts) and d.connector.counters.bytes_received == \
        p.connector.counters.bytes_sent > 0


def test_an_answer_sends_long_runs_of_blocks_in_place_and_gathers_the_short_ones():
    spans = np.arange(4 * 40 * 8, dtype=np.uint8).reshape(4, 40, 8)  # 4 rows, 40 blocks of 8 bytes
    ids = [3, 4, 5, 6, 9, 20, 21, 30, 31, 32, 33, 34, 35]
    # Runs of 4 and 6 blocks (32, 48 bytes per row) reach 32 bytes; 9 and 20-21 between them do not.
    assert pieces(ids, 8, min_bytes=32) == [(0, 4, True), (4, 7, False), (7, 13, True)]
    assert pieces([], 8, 32) == pieces([], 8, 0) == [(0, 0, False)] and pieces([7], 8, min_bytes=8) == [(0, 1, True)]
    frames, in_place = answer_frames(spans, ids, min_bytes=32)
    assert len(frames) == 3 * 4 and in_place == [True] * 4 + [False] * 4 + [True] * 4
    for frame, (row, piece) in zip(frames, [(r, p) for p in ([3, 4, 5, 6], [9, 20, 21], list(range(30, 36)))
                                            for r in range(4)]):
        assert np.array_equal(frame, spans[row, piece])  # each row's bytes of the piece's blocks, in order
        assert frame.flags.c_contiguous  # a frame is one buffer
        # In place: the cache's memory at the run's first block; gathered: a copy.
        assert np.shares_memory(frame, spans) == (piece[0] != 9)
        if piece[0] != 9:
            assert frame.ctypes.data == spans[row, piece[0]].ctypes.data


def test_the_benchmarks_copy_bug_copies_received_prompts_and_changes_nothing_else(engines, monkeypatch):
    """``leanserve bench disagg --copy-bug`` must measure a correct engine with only the seed's copy added."""
    held = []  # the prompt array each engine's enqueue was handed, in order
    enqueue = EngineCore.enqueue

    def recording_enqueue(self, add, ids):
        held.append(ids)
        enqueue(self, add, ids)

    monkeypatch.setattr(EngineCore, "enqueue", recording_enqueue)
    install_copy_bug()  # over the recording enqueue; monkeypatch puts the engine's back afterwards
    p, d, single = engines("kv_producer"), engines("kv_consumer"), engines(None)
    ids = prompt(50)
    d.add_request(2, ids, GREEDY, remote_prefill=prefill(p, 1, ids))
    single.add_request(3, ids, GREEDY)
    assert tokens(run(d, [2])[2]) == tokens(run(single, [3])[3])
    prefilled, received, aggregated = held
    assert np.shares_memory(prefilled, ids) and np.shares_memory(aggregated, ids)  # held as they came
    assert np.array_equal(received, ids) and not np.shares_memory(received, ids)  # the bug's copy


def test_n_samples_share_the_received_prompt(engines):
    p, d, single = engines("kv_producer"), engines("kv_consumer"), engines(None)
    ids = prompt(37)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=3)
    d.add_request(10, ids, params, remote_prefill=prefill(p, 1, ids))
    single.add_request(20, ids, params)
    got, want = run(d, [10, 11, 12]), run(single, [20, 21, 22])
    assert [tokens(got[10 + i]) for i in range(3)] == [tokens(want[20 + i]) for i in range(3)]
    partial = 37 % d.kv.block_size
    assert d.scheduler.prompt_tokens_total == 1 + 2 * partial  # siblings compute the partial block


@pytest.mark.parametrize("change,named", [
    (dict(block_size=8), f"block_size: {CPU_BLOCK_SIZE} on the prefill worker, 8 on the decode worker"),
    (dict(dtype=torch.bfloat16), "dtype: float32 on the prefill worker, bfloat16 on the decode worker"),
    (dict(seed=1), "model: llama-"),
])
def test_mismatched_workers_are_refused_at_first_contact_naming_the_mismatch(engines, change, named):
    p, d = engines("kv_producer"), engines("kv_consumer", **change)
    ids = prompt(40)
    remote = prefill(p, 1, ids)
    d.add_request(2, ids, GREEDY, remote_prefill=remote)
    (ev,) = run(d, [2])[2]
    assert ev.finish_reason == FinishReason.ERROR and "refused the transfer: KV layouts differ: " in ev.error
    assert named in ev.error
    assert d.kv.pool.num_used == 0 and not d.scheduler.receiving
    _wait_for(lambda: p.step() is None and p.kv.pool.num_used == 0)  # the refused lease is freed too


def test_stale_ids_and_a_restarted_prefill_worker(engines):
    port = free_port()
    p = engines("kv_producer", port=port)
    d = engines("kv_consumer")
    ids = prompt(40)
    remote = prefill(p, 1, ids)
    stale = RemotePrefill(remote.engine_id, remote.request_id, remote.epoch + 1, remote.block_ids, remote.host,
                          remote.port)
    d.add_request(2, ids, GREEDY, remote_prefill=stale)
    (ev,) = run(d, [2])[2]
    assert "no KV lease for request 1 epoch 2" in ev.error
    # The worker restarts on the same port with a new engine id: the old lease's params are
    # refused, naming the restart, and the decode engine's new requests reach the new worker.
    p.close()
    p2 = engines("kv_producer", port=port)
    d.add_request(3, ids, GREEDY, remote_prefill=remote)
    (ev,) = run(d, [3])[3]
    assert f"engine {remote.engine_id} is not this prefill worker's" in ev.error
    d.add_request(4, ids, GREEDY, remote_prefill=prefill(p2, 1, ids))
    assert len(tokens(run(d, [4])[4])) == GREEDY.max_tokens


def test_a_dead_prefill_worker_fails_the_request_within_the_timeout_and_others_decode_on(engines):
    p = engines("kv_producer")
    d = engines("kv_consumer", timeout=0.5)
    ids = prompt(40)
    remote = prefill(p, 1, ids)
    p.close()  # its side channel is gone: the pull is never answered
    d.add_request(5, prompt(8, seed=5), SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    d.add_request(6, ids, GREEDY, remote_prefill=remote)
    start = time.monotonic()
    events = run(d, [5, 6])
    (ev,) = events[6]
    assert ev.finish_reason == FinishReason.ERROR and "within kv_transfer_timeout_s=0.5" in ev.error
    assert len(tokens(events[5])) == 200  # decoded throughout, never stalled
    steps = d.stats.window()
    assert (steps[:, list(d.stats.index).index("num_waiting_for_kv")] > 0).sum() > 5  # decode steps ran meanwhile
    assert time.monotonic() - start >= 0.5 and d.kv.pool.num_used == 0


def test_a_decode_abort_releases_the_prefill_lease(engines):
    p, d = engines("kv_producer"), engines("kv_consumer", max_num_seqs=1)
    ids = prompt(40)
    d.add_request(1, prompt(8), SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    run_until = time.monotonic() + 5
    while not d.scheduler.running and time.monotonic() < run_until:
        d.step()
    d.add_request(2, ids, GREEDY, remote_prefill=prefill(p, 7, ids))  # queued: the one slot is taken
    d.step()
    assert p.connector.leases.num_held == 1
    d.abort([2])
    d.step()
    _wait_for(lambda: p.step() is None and p.connector.leases.num_held == 0 and p.kv.pool.num_used == 0)


def _wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)
