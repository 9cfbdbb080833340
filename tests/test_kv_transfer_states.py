"""The scheduler's disaggregated-serving states, without a model or a socket: the fake connector
(SGLang's ``fake`` backend) completes, fails or holds every load at once, and leases live and
expire as on a real prefill worker. Helpers and conventions as in ``test_scheduler.py`` (block
size 4; ``step`` = schedule + update_from_output with a fixed sampled token).
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from leanserve.engine.batch_state import BatchState
from leanserve.engine.kv_cache import BlockPool
from leanserve.engine.kv_transfer.config import KVTransferConfig
from leanserve.engine.kv_transfer.fake_connector import FakeConnector
from leanserve.engine.kv_transfer.messages import RemotePrefill
from leanserve.engine.params import SamplingParams
from leanserve.engine.request import FinishReason, Request, Status
from leanserve.engine.scheduler import Scheduler

from .test_scheduler import BS, MAX_MODEL_LEN, Plan, free_list, make_request, step


def make(free_blocks: int = 20, budget: int = 16, max_num_seqs: int = 8, outcome: str = "complete",
         **config) -> tuple[Scheduler, FakeConnector]:
    connector = FakeConnector(KVTransferConfig(engine_id="fake", **config), outcome)
    batch = BatchState(max_num_seqs, MAX_MODEL_LEN, BS)
    return Scheduler(batch, BlockPool(free_blocks + 1), budget, True, connector), connector


def remote(request_id: int = 900, num_cached_tokens: int = 0) -> RemotePrefill:
    return RemotePrefill("prefill-engine", request_id, 1, [11, 12, 13], "127.0.0.1", 5600, num_cached_tokens)


def receiver(rid: int, prompt_len: int = 10, n: int = 1, **kw) -> list[Request]:
    """A decode request (its n samples) whose prompt's KV waits on a prefill worker, as the
    engine queues it: the first sample receives, the others share."""
    first = make_request(rid, prompt_len, n=n, **kw)
    first.kv_remote = remote(rid + 900)
    samples = [first] + [make_request(rid, prompt_len, n=n, parent=first, **kw) for _ in range(n - 1)]
    for i, r in enumerate(samples):
        r.request_id, r.prefix_cacheable = rid + i, False
    return samples


def add(sched: Scheduler, reqs: list[Request]) -> None:
    for r in reqs:
        sched.add(r)


# ------------------------------------------------------------------------------ decode side


def test_a_receiver_holds_a_slot_and_its_prompts_blocks_then_runs_its_last_prompt_token_as_a_decode_row():
    sched, conn = make(outcome="hold")
    (r,) = receiver(1, prompt_len=10)
    add(sched, [r])
    assert step(sched) == Plan()  # admitted: no budget spent, nothing computed here
    assert r.status == Status.WAITING_FOR_REMOTE_KVS and r.block_ids == [1, 2, 3] and r.slot >= 0
    assert sched.prompt_tokens_total == 1 and not sched.running
    assert step(sched) == Plan()  # the transfer has not landed
    conn.loads.claim(1)
    conn.loads.finish(1, None)
    assert step(sched, token=55) == Plan(decode=[1])
    assert r.status == Status.RUNNING and r.num_computed_tokens == 10
    assert sched.batch.output_tokens(r.slot).tolist() == [55]
    assert sched.prompt_tokens_total == 1  # the prompt was computed elsewhere, but its last token


def test_a_receiver_waits_for_its_blocks_and_holds_a_batch_slot_while_receiving():
    sched, conn = make(free_blocks=4, max_num_seqs=1, outcome="hold")
    big = receiver(1, prompt_len=17)[0]  # 5 blocks: more than the pool has free
    first = make_request(2, 2, max_tokens=1)
    add(sched, [first, big])
    assert step(sched) == Plan(prefill=[(2, 0, 2)], finished=[2])
    assert step(sched) == Plan() and big.status == Status.WAITING  # 5 blocks never free: it waits
    sched.finish(big)
    assert conn.released == [big.kv_remote]
    small, other = receiver(3, prompt_len=13)[0], make_request(4, 2)
    add(sched, [small, other])
    assert step(sched) == Plan()
    # 13 tokens take all 4 blocks, and the one slot: the next request waits although idle.
    assert small.status == Status.WAITING_FOR_REMOTE_KVS and sched.pool.num_free == 0
    assert not sched.batch.has_free_slot and other.status == Status.WAITING
    remote_of_small = small.kv_remote
    sched.finish(small)  # aborted while receiving: blocks and slot back at once, lease released
    assert sched.pool.num_free == 4 and conn.released[-1] == remote_of_small
    assert step(sched) == Plan(prefill=[(4, 0, 2)])


def test_a_failed_transfer_ends_its_request_with_the_error_and_frees_it_while_others_run_on():
    sched, conn = make(outcome="fail")
    running = make_request(1, 3, max_tokens=8)
    sched.add(running)
    step(sched)
    (r,) = receiver(2)
    add(sched, [r])
    assert step(sched) == Plan(decode=[1])
    assert step(sched) == Plan(decode=[1])  # landed with an error: 2 is gone, 1 unaffected
    (failed, error), = sched.take_failed()
    assert failed is r and r.status == Status.FINISHED and error.startswith("KV transfer failed: ")
    assert r.slot == -1 and sched.pool.num_used == len(running.block_ids) and not sched.receiving


def test_a_transfer_that_never_lands_fails_within_the_timeout_and_releases_the_prefill_lease():
    sched, conn = make(outcome="hold", kv_transfer_timeout_s=0.05)
    (r,) = receiver(1)
    lease = r.kv_remote
    add(sched, [r])
    step(sched)
    assert step(sched) == Plan() and not sched.take_failed()
    time.sleep(0.06)
    step(sched)
    (failed, error), = sched.take_failed()
    assert failed is r and "within kv_transfer_timeout_s=0.05" in error
    assert conn.released == [lease] and sched.pool.num_used == 0 and sched.batch.has_free_slot
    # Bytes that arrive after the timeout find the load gone: nobody writes into freed blocks.
    assert conn.loads.claim(1) is None


def test_an_abort_while_the_bytes_are_being_written_frees_the_blocks_once_they_landed():
    sched, conn = make(outcome="hold")
    (r,) = receiver(1)
    add(sched, [r])
    step(sched)
    assert conn.loads.claim(1) is not None  # the transfer thread is writing into r's blocks
    sched.finish(r)
    assert r.status == Status.FINISHED and sched.pool.num_used == 3  # not yet: they are being written
    assert conn.released == []  # the lease was taken by the pull already
    conn.loads.finish(1, None)
    step(sched)
    assert sched.pool.num_used == 0 and not sched.receiving and not sched.running and not sched.take_failed()


def test_an_abort_before_admission_releases_the_prefill_lease():
    sched, conn = make(free_blocks=2, outcome="hold")
    first, (queued,) = make_request(1, 8), receiver(2)
    add(sched, [first, queued])
    step(sched)
    assert queued.status == Status.WAITING  # no blocks for it yet
    sched.finish(queued)
    assert conn.released == [queued.kv_remote] and queued.status == Status.FINISHED


def test_the_recompute_policy_computes_the_prompt_here_when_a_transfer_fails():
    sched, conn = make(outcome="fail", kv_load_failure_policy="recompute")
    (r,) = receiver(1, prompt_len=10)
    add(sched, [r])
    step(sched)
    assert step(sched) == Plan(prefill=[(1, 0, 10)])
    assert not sched.take_failed() and r.status == Status.RUNNING and sched.prompt_tokens_total == 10


def test_samples_after_the_first_share_the_received_prompt_blocks():
    sched, conn = make(outcome="hold")
    parent, sibling = receiver(1, prompt_len=10, n=2)
    add(sched, [parent, sibling])
    step(sched)
    assert sibling.status == Status.WAITING  # waits for the parent's prompt
    conn.loads.claim(1)
    conn.loads.finish(1, None)
    # The parent computes its last prompt token; the sibling shares its two full blocks and
    # computes the rest of the prompt itself (as in a single server); none enters the prefix cache.
    assert step(sched) == Plan(decode=[1])
    assert step(sched) == Plan(decode=[1], prefill=[(2, 8, 2)])
    assert sibling.block_ids[:2] == parent.block_ids[:2] and sibling.block_ids[2] != parent.block_ids[2]
    assert not sched.pool.cached


# ------------------------------------------------------------------------------ prefill side


def prefill(rid: int, prompt_len: int, **kw) -> Request:
    r = make_request(rid, prompt_len, max_tokens=1, **kw)
    r.do_remote_decode = True
    return r


def test_a_prefill_for_a_decode_worker_keeps_its_prompts_blocks_under_a_lease():
    sched, conn = make()
    r = prefill(1, 10)
    sched.add(r)
    out = sched.schedule()
    result = sched.update_from_output(out, np.array([5], np.int32))
    assert ids(result.finished) == [1] and r.status == Status.FINISHED and r.slot == -1
    (lease,) = result.leases
    assert (lease.request_id, lease.epoch, lease.block_ids) == (1, 1, [1, 2, 3])
    assert sched.pool.num_used == 3
    assert conn.pulled(1, 1)  # a decode worker took the bytes: the blocks go at the next iteration
    sched.schedule()
    assert sched.pool.num_used == 0


def ids(reqs):
    return [r.request_id for r in reqs]


def test_a_prefill_that_stops_on_eos_keeps_nothing():
    sched, _ = make()
    r = Request(1, np.arange(100, 110, dtype=np.int32), SamplingParams(max_tokens=1, stop_token_ids=[9]))
    r.do_remote_decode = True
    sched.add(r)
    result = sched.update_from_output(sched.schedule(), np.array([9], np.int32))
    assert result.finish_reasons.tolist() == [FinishReason.STOP] and not result.leases
    assert sched.pool.num_used == 0


def test_a_lease_expires_and_a_stale_epoch_is_refused():
    sched, conn = make(kv_lease_timeout_s=0.05)
    for rid in (1, 2):
        sched.add(prefill(rid, 6))
    leases = sched.update_from_output(sched.schedule(), np.array([5, 5], np.int32)).leases
    assert [lease.epoch for lease in leases] == [1, 2]
    assert not conn.pulled(1, 2)  # request 1's id with request 2's epoch: not a lease
    sched.drop_lease(2)  # its own client left: freed at once
    assert sched.pool.num_used == 2
    time.sleep(0.06)
    sched.schedule()
    assert sched.pool.num_used == 0 and conn.leases.expired_total == 1
    assert not conn.pulled(1, 1)  # expired


def test_no_block_leaks_under_many_cancelled_and_expired_leases():
    """Random interleavings of prefills leased, pulled, released, dropped and expired: every
    block returns to the pool, each exactly once (a double free would corrupt the free list)."""
    rng = random.Random(0)
    sched, conn = make(free_blocks=40, budget=64, max_num_seqs=8, kv_lease_timeout_s=0.002)
    rid, live = 0, []
    for _ in range(300):
        action = rng.choice(["add", "add", "pull", "release", "drop", "wait"])
        if action == "add" and len(sched.waiting) < 4:
            rid += 1
            sched.add(prefill(rid, rng.randint(1, 12)))
        elif action in ("pull", "release") and live:
            lease = live.pop(rng.randrange(len(live)))
            conn.pulled(lease.request_id, lease.epoch)  # a release ends a lease the same way
        elif action == "drop" and live:
            sched.drop_lease(live.pop(rng.randrange(len(live))).request_id)
        elif action == "wait":
            time.sleep(0.003)
        out = sched.schedule()
        if not out.empty:
            live += sched.update_from_output(out, np.full(len(out.sample_slots), 5, np.int32)).leases
    time.sleep(0.003)
    sched.schedule()
    assert conn.leases.num_held == 0 and sched.pool.num_used == 0
    assert sorted(free_list(sched.pool)) == list(range(1, 41))
    assert conn.counters.leases_created > 50 and conn.leases.expired_total > 5


@pytest.mark.parametrize("text,message", [
    ('{"kv_connector": "NixlConnector"}', "kv_connector: one of ZmqConnector"),
    ('{"kv_role": "kv_decoder"}', "kv_role: one of kv_producer, kv_consumer, kv_both"),
    ('{"kv_port": 0}', "kv_port: must be in [1, 65535]"),
    ('{"kv_buffer_size": 1e9}', "unknown field `kv_buffer_size`"),
    ('{"kv_connector_extra_config": {"copy_bug": true}}', "kv_connector_extra_config: ZmqConnector takes no "
                                                          "options, got ['copy_bug']"),
    ('{"kv_transfer_timeout_s": "soon"}', "Expected `float`, got `str` - at `$.kv_transfer_timeout_s`"),
    ("kv_both", "not JSON"),
])
def test_a_bad_kv_transfer_config_names_the_field(text, message):
    with pytest.raises(ValueError, match="^--kv-transfer-config: .*" + message.replace("[", r"\[").replace(
            "$", r"\$")):
        KVTransferConfig.from_json(text)


def test_data_parallel_engines_get_their_own_side_channel_and_engine_id():
    """vLLM offsets the side-channel port by the data-parallel rank; a lease names its engine.
    The launcher gives each engine its own (``EngineProcesses.start``), whatever the number of
    API processes."""
    from leanserve.engine.config import EngineConfig
    from leanserve.engine.launch import kv_side_channel

    kv = KVTransferConfig(kv_port=5600, engine_id="e")
    config = EngineConfig(kv_transfer=kv).resolve()
    engines = [kv_side_channel(config, k, 3).engine.kv_transfer for k in range(3)]
    assert [(e.kv_port, e.engine_id) for e in engines] == [(5600, "e-dp0"), (5601, "e-dp1"), (5602, "e-dp2")]
    assert kv_side_channel(config, 0, 1).engine.kv_transfer == kv
