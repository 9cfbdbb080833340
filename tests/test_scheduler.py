"""The scheduler, the KV block pool and the persistent batch, without a model.

In the style of vLLM's tests/v1/core/test_scheduler.py: small helpers build requests and a
Scheduler over a BatchState and a BlockPool with a small, exact block budget; ``step`` runs one
iteration of the engine with the model replaced by a fixed sampled token (``run_step`` does the
scheduler's post-forward bookkeeping, ``update_from_output``, as the engine does). Each test states one scheduling
rule and checks exact numbers: who gets how many tokens, which blocks, in which order.

Block size is 4 throughout, so "prompt 10" means two full blocks and a partial one.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leanserve.cli import _engine_config, build_parser
from leanserve.engine.batch_state import BatchState
from leanserve.engine.config import (AMX_PREFILL_CHUNK, CPU_BLOCK_SIZE, CPU_PREFILL_CHUNK, CPU_PREFILL_TOKENS,
                                     EngineConfig, default_max_num_batched_tokens, default_max_prefill_tokens,
                                     runs_linear_layers_on_amx)
from leanserve.engine.kv_cache import BlockPool
from leanserve.engine.params import SamplingParams
from leanserve.engine.request import FinishReason, Request, Status
from leanserve.engine.scheduler import ScheduledBatch, Scheduler
from leanserve.model.prepack import has_amx

BS = 4  # tokens per KV block
MAX_MODEL_LEN = 64
TOKEN = 7  # the "sampled" token when a test does not care which


# ---------------------------------------------------------------------------------------- helpers
def make_scheduler(free_blocks: int, budget: int, max_num_seqs: int = 8, prefix_caching: bool = True,
                   prefill_budget: int | None = None) -> Scheduler:
    """A scheduler whose pool hands out exactly ``free_blocks`` blocks (block 0, the null block,
    is never handed out). No EOS ids: requests stop on length only. ``budget`` is every step's
    unless ``prefill_budget`` is given for steps in which nothing decodes."""
    batch = BatchState(max_num_seqs, MAX_MODEL_LEN, BS)
    return Scheduler(batch, BlockPool(free_blocks + 1), budget, prefix_caching, max_prefill_tokens=prefill_budget)


def make_request(rid: int, prompt_len: int | None = None, *, prompt=None, max_tokens: int = 16, n: int = 1,
                 parent: Request | None = None) -> Request:
    """A request whose prompt, unless given, is ``rid * 100 + [0, prompt_len)``: prompts of
    different requests never share a prefix by accident."""
    if prompt is None:
        prompt = np.arange(rid * 100, rid * 100 + prompt_len, dtype=np.int32)
    return Request(rid, np.asarray(prompt, np.int32), SamplingParams(n=n, max_tokens=max_tokens), prefix_parent=parent)


def run_step(sched: Scheduler, out: ScheduledBatch, token: int = TOKEN) -> list[Request]:
    """What the engine does after the forward of ``out``, with ``token`` as every sampled id:
    ``update_from_output``. Returns the requests that finished."""
    tokens = np.full(len(out.sample_slots), token, np.int32)
    return sched.update_from_output(out, tokens).finished


class Plan(NamedTuple):
    """One iteration by request id: decode rows, prefill chunks (id, start, length), the requests
    preempted, and those that finished after the step."""

    decode: list[int] = []
    prefill: list[tuple[int, int, int]] = []
    preempted: list[int] = []
    finished: list[int] = []


def step(sched: Scheduler, token: int = TOKEN) -> Plan:
    """One engine iteration: schedule, then the post-forward bookkeeping."""
    out = sched.schedule()
    decode = [sched.batch.requests[s].request_id for s in out.decode_slots]  # read before finishes clear slots
    prefill = [(c.request.request_id, c.start, c.length) for c in out.prefills]
    finished = run_step(sched, out, token)
    return Plan(decode, prefill, [r.request_id for r in out.preempted], [r.request_id for r in finished])


def free_list(pool: BlockPool) -> list[int]:
    """Free block ids in the order allocate() hands them out (least recently freed first)."""
    out, b = [], pool._head.next
    while b is not pool._head:
        out.append(b.block_id)
        b = b.next
    return out


def ids(reqs) -> list[int]:
    return [r.request_id for r in reqs]


# ------------------------------------------------------------------------- token budget, chunks
def test_budget_goes_to_running_requests_first_then_waiting_in_arrival_order():
    sched = make_scheduler(free_blocks=20, budget=10)
    for rid in (1, 2, 3):
        sched.add(make_request(rid, 6))
    # Nothing runs yet: 1 takes 6 tokens, 2 the 4 left; 3 must wait (the budget is spent).
    assert step(sched) == Plan(prefill=[(1, 0, 6), (2, 0, 4)])
    # 1 decodes (one token), 2 finishes its prompt before 3, which arrived later, starts.
    assert step(sched) == Plan(decode=[1], prefill=[(2, 4, 2), (3, 0, 6)])
    assert step(sched) == Plan(decode=[1, 2, 3])
    assert [len(sched.batch.output_tokens(r.slot)) for r in sched.running] == [3, 2, 2]


def test_waiting_requests_start_only_with_budget_left_by_running_ones():
    sched = make_scheduler(free_blocks=20, budget=2)
    for rid in (1, 2, 3):
        sched.add(make_request(rid, 1, max_tokens=2))
    assert step(sched) == Plan(prefill=[(1, 0, 1), (2, 0, 1)])
    # Two decodes spend the budget: 3 waits although a slot and blocks are free.
    assert step(sched) == Plan(decode=[1, 2], finished=[1, 2])
    assert ids(sched.waiting) == [3]
    assert step(sched) == Plan(prefill=[(3, 0, 1)])


def test_chunked_prefill_splits_a_long_prompt_by_the_budget_while_decodes_continue():
    sched = make_scheduler(free_blocks=20, budget=8)
    short, long = make_request(1, 3, max_tokens=10), make_request(2, 21)
    sched.add(short)
    sched.add(long)
    plans, long_blocks = [], []
    for _ in range(5):
        plans.append(step(sched))
        long_blocks.append(len(long.block_ids))
    assert plans == [
        Plan(prefill=[(1, 0, 3), (2, 0, 5)]),
        Plan(decode=[1], prefill=[(2, 5, 7)]),  # 1 decode + a 7-token chunk = the budget of 8
        Plan(decode=[1], prefill=[(2, 12, 7)]),
        Plan(decode=[1], prefill=[(2, 19, 2)]),  # the last chunk samples the long prompt's first token
        Plan(decode=[1, 2]),
    ]
    # Blocks are allocated as chunks need them: ceil(5/4), ceil(12/4), ceil(19/4), ceil(21/4), then
    # position 21 still fits in block 6.
    assert long_blocks == [2, 3, 5, 6, 6]
    assert len(sched.batch.output_tokens(short.slot)) == 5 and len(sched.batch.output_tokens(long.slot)) == 2


def test_a_step_in_which_nothing_decodes_takes_the_prefill_budget():
    sched = make_scheduler(free_blocks=30, budget=8, prefill_budget=20)
    sched.add(make_request(1, 12, max_tokens=3))
    sched.add(make_request(2, 12, max_tokens=3))
    sched.add(make_request(3, 30))
    # Nothing runs: 20 tokens (1's prompt and 8 of 2's). Then 1 decodes, so the step budget of 8
    # holds again (1 decode row + 7 of 2's prompt), until no request decodes.
    assert step(sched) == Plan(prefill=[(1, 0, 12), (2, 0, 8)])
    assert step(sched) == Plan(decode=[1], prefill=[(2, 8, 4), (3, 0, 3)])
    assert step(sched) == Plan(decode=[1, 2], prefill=[(3, 3, 6)], finished=[1])
    assert step(sched) == Plan(decode=[2], prefill=[(3, 9, 7)], finished=[2])
    # 3 alone, still in its prompt: nothing decodes, the rest of it (14 of 20) in one step.
    assert step(sched) == Plan(prefill=[(3, 16, 14)])
    assert step(sched) == Plan(decode=[3])


def test_a_prompt_with_one_token_left_is_a_decode_row_and_keeps_the_step_budget():
    """What "decoding" means to the budget: a request granted exactly its one remaining token (a
    decode row), whether that token was sampled or is its prompt's last."""
    sched = make_scheduler(free_blocks=30, budget=4, prefill_budget=12)
    sched.add(make_request(1, 13, max_tokens=2))
    sched.add(make_request(2, 20))
    assert step(sched) == Plan(prefill=[(1, 0, 12)])  # nothing decodes: 12 of 13
    # 1's last prompt token is a decode row: the step budget of 4 holds (and 2 gets 3 of it).
    assert step(sched) == Plan(decode=[1], prefill=[(2, 0, 3)])
    assert step(sched) == Plan(decode=[1], prefill=[(2, 3, 3)], finished=[1])
    assert step(sched) == Plan(prefill=[(2, 6, 12)])  # nobody decodes again


def test_the_prefill_budget_defaults_per_device_and_follows_a_given_step_budget():
    parse = build_parser().parse_args
    config = _engine_config(parse(["serve"]))
    assert config.max_prefill_tokens == max(CPU_PREFILL_TOKENS, config.max_num_batched_tokens) == 2048
    # A step budget given alone bounds every step.
    assert _engine_config(parse(["serve", "--max-num-batched-tokens", "4096"])).max_prefill_tokens == 4096
    assert _engine_config(parse(["serve", "--max-num-batched-tokens", "256"])).max_prefill_tokens == 256
    assert _engine_config(parse(["serve", "--max-num-batched-tokens", "256", "--max-prefill-tokens", "1024"])
                          ).max_prefill_tokens == 1024
    assert _engine_config(parse(["serve", "--max-prefill-tokens", "8192"])).max_prefill_tokens == 8192
    assert _engine_config(parse(["serve", "--device", "cuda"])).max_prefill_tokens == 2048
    assert default_max_prefill_tokens("cuda", 512) == 512
    with pytest.raises(ValueError, match=r"max_prefill_tokens \(--max-prefill-tokens\): must be >= "
                                         r"max_num_batched_tokens \(384\), got 100"):
        EngineConfig(max_num_batched_tokens=384, max_prefill_tokens=100).validate()
    # A scheduler given none (or less) keeps its step budget for every step.
    batch = BatchState(4, MAX_MODEL_LEN, BS)
    assert Scheduler(batch, BlockPool(9), 8).max_prefill_tokens == 8


def test_default_budget_is_per_device_and_the_flag_overrides_it():
    parse = build_parser().parse_args
    assert default_max_num_batched_tokens("cpu", 64) == 64 + CPU_PREFILL_CHUNK == 192
    assert default_max_num_batched_tokens("cpu", 64, amx_linear_layers=True) == 64 + AMX_PREFILL_CHUNK
    chunk = AMX_PREFILL_CHUNK if runs_linear_layers_on_amx("cpu", "auto", "none") else CPU_PREFILL_CHUNK
    assert _engine_config(parse(["serve"])).max_num_batched_tokens == 64 + chunk
    assert _engine_config(parse(["serve", "--max-num-seqs", "128"])).max_num_batched_tokens == 128 + chunk
    # GEMMs without AMX's tiles keep the smaller chunk on every CPU
    assert _engine_config(parse(["serve", "--dtype", "float32"])).max_num_batched_tokens == 192
    assert _engine_config(parse(["serve", "--quantization", "int8"])).max_num_batched_tokens == 192
    assert _engine_config(parse(["serve", "--device", "cuda"])).max_num_batched_tokens == 2048
    assert _engine_config(parse(["serve", "--device", "cuda:1", "--max-num-seqs", "4096"])).max_num_batched_tokens \
        == 4096
    assert _engine_config(parse(["serve", "--max-num-batched-tokens", "2048"])).max_num_batched_tokens == 2048
    assert EngineConfig(max_num_batched_tokens=8).max_num_batched_tokens == 8


def test_the_larger_cpu_chunk_is_for_bf16_linear_layers_on_amx():
    amx = has_amx()  # this machine's: the other branch is covered on the other kind of CPU
    assert runs_linear_layers_on_amx("cpu", "auto", "none") == amx
    assert runs_linear_layers_on_amx("cpu", torch.bfloat16, "none") == amx
    for dtype, quantization in [("float32", "none"), ("auto", "int8"), ("bfloat16", "gguf")]:
        assert not runs_linear_layers_on_amx("cpu", dtype, quantization)
    assert not runs_linear_layers_on_amx("cuda", "auto", "none")


def test_default_block_size_is_per_device_and_the_flag_overrides_it():
    parse = build_parser().parse_args
    assert _engine_config(parse(["serve"])).block_size == CPU_BLOCK_SIZE == 32
    assert _engine_config(parse(["serve", "--device", "cuda"])).block_size == 16
    assert _engine_config(parse(["serve", "--block-size", "16"])).block_size == 16
    assert EngineConfig(block_size=8).block_size == 8
    with pytest.raises(ValueError, match="block_size: must be >= 1"):
        EngineConfig(block_size=0).validate()


@pytest.mark.parametrize("max_num_seqs", [4, 64])
def test_cpu_default_budget_decodes_every_row_beside_a_full_chunk(max_num_seqs):
    """A long prompt arriving beside a full batch is chunked by the default chunk (plus the one
    row its own slot leaves), and no decode row waits a step for it."""
    budget = EngineConfig(max_num_seqs=max_num_seqs).max_num_batched_tokens
    batch = BatchState(max_num_seqs, 2048, BS)
    sched = Scheduler(batch, BlockPool(2048 // BS * max_num_seqs + 1), budget)
    decoders = [make_request(rid, 3, max_tokens=100) for rid in range(max_num_seqs - 1)]
    for req in decoders:
        sched.add(req)
    assert step(sched).prefill == [(r.request_id, 0, 3) for r in decoders]
    chunk = budget - max_num_seqs + 1
    prompt_len = 3 * chunk + 100
    sched.add(make_request(999, prompt_len))
    plans = [step(sched) for _ in range(4)]
    assert [p.prefill for p in plans] == [[(999, 0, chunk)], [(999, chunk, chunk)], [(999, 2 * chunk, chunk)],
                                          [(999, 3 * chunk, 100)]]
    assert all(p.decode == ids(decoders) for p in plans)


def test_one_remaining_prompt_token_is_scheduled_as_a_decode_row():
    # A row is a decode when it computes exactly its one newest known token; that token may be
    # the prompt's last: the decode input is last_token, which admission set to prompt[-1].
    sched = make_scheduler(free_blocks=20, budget=4)
    req = make_request(1, 5)
    sched.add(req)
    assert step(sched) == Plan(prefill=[(1, 0, 4)])
    assert sched.batch.last_token[req.slot] == req.prompt[-1]
    assert step(sched, token=55) == Plan(decode=[1])
    assert sched.batch.output_tokens(req.slot).tolist() == [55]


# ------------------------------------------------------------------------- update_from_output
def test_only_chunks_that_reach_the_last_known_token_sample():
    sched = make_scheduler(free_blocks=20, budget=8)
    a, b = make_request(1, 3), make_request(2, 10)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(c.request.request_id, c.length, c.samples) for c in out.prefills] == [(1, 3, True), (2, 5, False)]
    assert out.sample_slots.tolist() == [a.slot]
    result = sched.update_from_output(out, np.array([42], np.int32))
    assert result.request_ids.tolist() == [1] and result.token_ids.tolist() == [42]
    assert result.finish_reasons.tolist() == [0] and not result.finished
    # Decode rows first, then sampling chunks, as the model input lays out its rows.
    out = sched.schedule()
    assert out.decode_slots.tolist() == [a.slot] and out.sample_slots.tolist() == [a.slot, b.slot]


def test_update_finishes_on_length_and_on_a_stop_id_and_frees_at_once():
    sched = make_scheduler(free_blocks=20, budget=16)
    by_length = make_request(1, 3, max_tokens=1)
    by_stop = Request(2, np.arange(200, 203, dtype=np.int32), SamplingParams(max_tokens=8, stop_token_ids=[9]))
    running_on = make_request(3, 3)
    for r in (by_length, by_stop, running_on):
        sched.add(r)
    out = sched.schedule()
    result = sched.update_from_output(out, np.array([5, 9, 9], np.int32))
    assert result.finish_reasons.tolist() == [FinishReason.LENGTH, FinishReason.STOP, 0]
    assert ids(result.finished) == [1, 2] and ids(sched.running) == [3]
    assert by_length.slot == -1 and by_length.block_ids == [] and by_stop.status == Status.FINISHED
    assert sched.pool.num_free == 20 - 1


def test_counters_count_a_prompt_once_at_first_admission_and_every_sampled_token():
    sched = make_scheduler(free_blocks=20, budget=4)
    req = make_request(1, 5, max_tokens=3)
    sched.add(req)
    assert step(sched) == Plan(prefill=[(1, 0, 4)])
    assert (sched.prompt_tokens_total, sched.generation_tokens_total) == (5, 0)
    # The prompt's fifth token is computed by a decode row, which samples the first token.
    assert step(sched) == Plan(decode=[1])
    assert (sched.prompt_tokens_total, sched.generation_tokens_total) == (5, 1)
    step(sched)
    assert step(sched) == Plan(decode=[1], finished=[1])
    assert (sched.prompt_tokens_total, sched.generation_tokens_total) == (5, 3)
    assert len(sched.queue_times) == 1


def test_the_scheduled_decode_slots_are_the_callers_to_keep():
    # The scheduler caches its running slots between steps; what it hands out must not alias it.
    sched = make_scheduler(free_blocks=20, budget=8)
    for rid in (1, 2):
        sched.add(make_request(rid, 2))
    step(sched)
    out = sched.schedule()
    running = sched._slots().tolist()
    assert out.decode_slots.tolist() == running
    out.decode_slots[:] = 99
    assert sched._slots().tolist() == running


# ------------------------------------------------------------------------------------ preemption
def preemption_scenario(prefix_caching: bool) -> tuple[Scheduler, dict[int, Request], Plan]:
    """7 blocks, three requests filling 6 of them (blocks 1-2, 3-4, 5-6), then a step in which the
    two oldest both open a new block: 1 takes the last free block, 2 finds none.

    Returns the scheduler, the requests by id and the plan of that second step.
    """
    sched = make_scheduler(free_blocks=7, budget=32, prefix_caching=prefix_caching)
    reqs = {1: make_request(1, 8, max_tokens=2), 2: make_request(2, 8), 3: make_request(3, 5)}
    for r in reqs.values():
        sched.add(r)
    assert step(sched, token=101) == Plan(prefill=[(1, 0, 8), (2, 0, 8), (3, 0, 5)])
    assert (reqs[1].block_ids, reqs[2].block_ids, reqs[3].block_ids) == ([1, 2], [3, 4], [5, 6])
    assert sched.pool.num_free == 1
    reqs[4] = make_request(4, 3)  # arrives while the pool is dry
    sched.add(reqs[4])
    return sched, reqs, step(sched, token=102)


def test_pool_running_dry_preempts_the_newest_running_request():
    sched, r, plan = preemption_scenario(prefix_caching=True)
    # 3 is preempted although it needed no block itself: it is the newest. 1 then finishes
    # (8 + 2 tokens). Nothing is admitted in an iteration that preempted, not even 4, which would
    # have fit in the block left over.
    assert plan == Plan(decode=[1, 2], preempted=[3], finished=[1])
    assert sched.num_preemptions == 1 and r[3].num_preemptions == 1
    assert r[3].status == Status.WAITING and ids(sched.waiting) == [3, 4]  # back at the head
    assert r[3].slot == -1 and r[3].block_ids == [] and r[3].num_computed_tokens == 0
    assert r[3].saved_output.tolist() == [101]
    assert r[2].block_ids == [3, 4, 6]  # 3's blocks went back to the pool, 2 took one of them
    assert ids(sched.running) == [2]
    # 1's 3 blocks, plus 3's block 5 that 2 did not take.
    assert sched.pool.num_free == 4


def test_preempted_request_is_recomputed_from_its_prompt_and_generated_tokens():
    sched, r, _ = preemption_scenario(prefix_caching=False)
    # 3 resumes with all 5 + 1 tokens to compute (no prefix cache), before 4, which arrived later.
    assert step(sched, token=103) == Plan(decode=[2], prefill=[(3, 0, 6), (4, 0, 3)])
    slot = r[3].slot
    assert sched.batch.tokens(r[3], 0, 7).tolist() == list(range(300, 305)) + [101, 103]
    assert sched.batch.output_tokens(slot).tolist() == [101, 103]  # the saved output, then the new token
    assert r[3].saved_output is None and r[3].block_ids == [5, 7]
    assert sched.batch.output_tokens(r[2].slot).tolist() == [101, 102, 103]
    assert sched.num_preemptions == 1


def test_preempted_request_resumes_from_its_cached_full_blocks():
    sched, r, _ = preemption_scenario(prefix_caching=True)
    # 3's full first block (block 5) was freed but never reallocated: it is a prefix hit, so only
    # tokens 4-5 (the prompt's last and the sampled one) are recomputed.
    assert step(sched, token=103) == Plan(decode=[2], prefill=[(3, 4, 2), (4, 0, 3)])
    assert r[3].block_ids == [5, 7]
    assert sched.batch.output_tokens(r[3].slot).tolist() == [101, 103]
    # Resumptions are not prefix-cache traffic: num_cached_tokens and the hit counters describe
    # first admissions only.
    assert r[3].num_cached_tokens == 0
    assert (sched.prefix_queries, sched.prefix_hits) == (8 + 8 + 5 + 3, 0)
    assert sched.prompt_tokens_total == 8 + 8 + 5 + 3 and len(sched.queue_times) == 4


def test_a_request_preempts_itself_when_it_is_the_newest():
    sched = make_scheduler(free_blocks=4, budget=32)
    sched.add(make_request(1, 7))  # position 7 still fits in its second block
    sched.add(make_request(2, 8))  # position 8 needs a third block
    assert step(sched) == Plan(prefill=[(1, 0, 7), (2, 0, 8)])
    assert sched.pool.num_free == 0
    assert step(sched) == Plan(decode=[1], preempted=[2])
    assert sched.pool.num_free == 2 and ids(sched.waiting) == [2]


def test_preempted_requests_return_to_the_head_of_the_queue_in_arrival_order():
    sched = make_scheduler(free_blocks=4, budget=16)
    for rid in (1, 2, 3, 4):
        sched.add(make_request(rid, 4, max_tokens=2 if rid <= 2 else 16))
    assert step(sched) == Plan(prefill=[(1, 0, 4), (2, 0, 4), (3, 0, 4), (4, 0, 4)])
    sched.add(make_request(5, 2))
    # Every request opens its second block with none free: 1 preempts 4 (the newest), 2 then
    # preempts 3. They queue ahead of 5 in their original order.
    assert step(sched) == Plan(decode=[1, 2], preempted=[4, 3], finished=[1, 2])
    assert ids(sched.waiting) == [3, 4, 5] and sched.num_preemptions == 2
    # 1 and 2 took (and so evicted) the blocks 4 and 3 gave back: no prefix hits; 3 and 4 take
    # the four blocks 1 and 2 freed and 5 waits for one.
    assert step(sched) == Plan(prefill=[(3, 0, 5), (4, 0, 5)])
    assert ids(sched.waiting) == [5] and sched.pool.num_free == 0


# ------------------------------------------------------------------------------------ block pool
def test_block_pool_frees_a_requests_blocks_in_reverse_so_its_tail_is_evicted_first():
    # BlockPool.free walks the ids backwards and appends each block that drops to ref 0 to the
    # free list's tail; allocate pops the head (the least recently freed). So a request's last
    # block is evicted first and its first block, the likeliest to be shared, last.
    pool = BlockPool(7)
    assert free_list(pool) == [1, 2, 3, 4, 5, 6]
    first, second = pool.allocate(3), pool.allocate(3)
    assert (first, second) == ([1, 2, 3], [4, 5, 6]) and pool.num_free == 0
    for bid in first + second:
        pool.register(bid, b"key%d" % bid)
    pool.free(first)
    pool.free(second)
    assert free_list(pool) == [3, 2, 1, 6, 5, 4]
    # Reallocating a cached block evicts its key; the other freed blocks stay hits.
    assert pool.allocate(1) == [3]
    assert pool.lookup(b"key3") is None and pool.lookup(b"key2") == 2 and pool.lookup(b"key1") == 1
    assert pool.blocks[3].ref_count == 1 and pool.blocks[3].key is None


def test_block_pool_a_hit_on_a_free_cached_block_takes_it_off_the_free_list():
    pool = BlockPool(5)
    blocks = pool.allocate(4)
    for bid in blocks:
        pool.register(bid, b"key%d" % bid)
    pool.free(blocks)
    assert free_list(pool) == [4, 3, 2, 1]
    pool.share([2])  # a prefix hit: unlinked from the middle of the LRU list, contents kept
    assert free_list(pool) == [4, 3, 1] and pool.num_free == 3 and pool.blocks[2].ref_count == 1
    assert pool.allocate(3) == [4, 3, 1]
    assert pool.lookup(b"key2") == 2 and pool.lookup(b"key1") is None
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free([2])  # back at the tail, still cached
    assert free_list(pool) == [2] and pool.lookup(b"key2") == 2


def test_block_pool_shared_blocks_return_to_the_free_list_with_their_last_reference():
    pool = BlockPool(5)
    blocks = pool.allocate(2)
    pool.share(blocks)
    assert [pool.blocks[b].ref_count for b in blocks] == [2, 2] and pool.num_used == 2
    pool.free(blocks)
    assert [pool.blocks[b].ref_count for b in blocks] == [1, 1] and free_list(pool) == [3, 4]
    pool.free(blocks)
    assert [pool.blocks[b].ref_count for b in blocks] == [0, 0] and free_list(pool) == [3, 4, 2, 1]
    assert pool.num_used == 0


def test_block_pool_keeps_the_first_block_registered_under_a_key():
    pool = BlockPool(5)
    a, b = pool.allocate(2)
    pool.register(a, b"same")
    pool.register(b, b"same")  # a duplicate: the second block stays unkeyed
    assert pool.lookup(b"same") == a and pool.blocks[b].key is None


# ---------------------------------------------------------------------------------- prefix cache
PROMPT = np.arange(1000, 1010, dtype=np.int32)  # 10 tokens: two full blocks and a partial one


def test_prefix_hit_shares_full_blocks_but_never_the_partial_last_block():
    sched = make_scheduler(free_blocks=20, budget=32)
    a = make_request(1, prompt=PROMPT)
    sched.add(a)
    assert step(sched) == Plan(prefill=[(1, 0, 10)])
    b = make_request(2, prompt=PROMPT.copy())
    sched.add(b)
    # Same 10 tokens: the two full blocks are hits, the partial third block is computed anew.
    assert step(sched) == Plan(decode=[1], prefill=[(2, 8, 2)])
    assert b.num_cached_tokens == 8
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert [sched.pool.blocks[x].ref_count for x in a.block_ids] == [2, 2, 1]
    # Only the first block matches: k = 1 full block, 4 cached tokens.
    c = make_request(3, prompt=np.concatenate((PROMPT[:4], [5, 5, 5, 5, 5])))
    sched.add(c)
    assert step(sched) == Plan(decode=[1, 2], prefill=[(3, 4, 5)])
    assert c.num_cached_tokens == 4 and c.block_ids[0] == a.block_ids[0]
    assert sched.pool.blocks[a.block_ids[0]].ref_count == 3
    assert (sched.prefix_queries, sched.prefix_hits) == (10 + 10 + 9, 8 + 4)


def test_prefix_counters_count_a_request_once_even_when_it_waits_for_blocks():
    # prefix_queries / prefix_hits (exported as the prefix_cache_queries / _hits counters) are
    # meant to count first admissions only. A request at the head of the queue that finds its
    # hits but not enough free blocks is looked up again every iteration until it fits.
    sched = make_scheduler(free_blocks=4, budget=32)
    a = make_request(1, prompt=PROMPT[:8])
    sched.add(a)
    assert step(sched) == Plan(prefill=[(1, 0, 8)])
    b = make_request(2, prompt=np.concatenate((PROMPT[:8], np.arange(50, 58))))  # a's 2 blocks + 2 more
    sched.add(b)
    # a opens its third block; b would hit a's two blocks but needs two more with one free.
    assert step(sched) == Plan(decode=[1])
    assert step(sched) == Plan(decode=[1])
    sched.finish(a)
    assert step(sched) == Plan(prefill=[(2, 8, 8)])
    assert b.num_cached_tokens == 8 and b.block_ids[:2] == [1, 2]
    assert (sched.prefix_queries, sched.prefix_hits) == (8 + 16, 8)


def test_a_fully_cached_prompt_still_computes_its_last_block():
    # At least one token must be computed (its logits give the first output token), so a lookup
    # covers at most (prompt - 1) // block_size blocks: an 8-token prompt whose two blocks are
    # both cached hits only the first and recomputes all 4 tokens of the second.
    sched = make_scheduler(free_blocks=20, budget=32)
    a = make_request(1, prompt=PROMPT)
    sched.add(a)
    step(sched)
    b = make_request(2, prompt=PROMPT[:8])
    sched.add(b)
    assert step(sched) == Plan(decode=[1], prefill=[(2, 4, 4)])
    assert b.num_cached_tokens == 4 and b.block_ids[0] == a.block_ids[0] and b.block_ids[1] != a.block_ids[1]


def test_identical_prompts_admitted_in_one_step_do_not_share():
    # Blocks enter the prefix cache after their forward (register_full_blocks in the update), so
    # a request admitted in the same iteration as the one computing its prefix misses. (n > 1
    # samples avoid this by waiting for the first sample: see the next test.)
    sched = make_scheduler(free_blocks=20, budget=32)
    a, b = make_request(1, prompt=PROMPT), make_request(2, prompt=PROMPT)
    sched.add(a)
    sched.add(b)
    assert step(sched) == Plan(prefill=[(1, 0, 10), (2, 0, 10)])
    assert b.num_cached_tokens == 0 and not set(a.block_ids) & set(b.block_ids)


def test_n_samples_wait_for_the_first_samples_prompt_then_share_its_full_blocks():
    # Prefix caching is off: n > 1 samples share anyway; an unrelated request does not.
    sched = make_scheduler(free_blocks=20, budget=6, prefix_caching=False)
    first = make_request(10, prompt=PROMPT, n=3)
    siblings = [make_request(rid, prompt=PROMPT, n=3, parent=first) for rid in (11, 12)]
    other = make_request(13, prompt=PROMPT)
    for r in (first, *siblings, other):
        sched.add(r)
    assert step(sched) == Plan(prefill=[(10, 0, 6)])
    # 2 tokens of budget are left, but 11 waits: 10's prompt is not computed yet (and 11 holds
    # up the queue behind it).
    assert step(sched) == Plan(prefill=[(10, 6, 4)])
    assert ids(sched.waiting) == [11, 12, 13]
    # Now both siblings hit 10's two full blocks; 13 gets the one token of budget left, uncached.
    assert step(sched) == Plan(decode=[10], prefill=[(11, 8, 2), (12, 8, 2), (13, 0, 1)])
    for s in siblings:
        assert s.block_ids[:2] == first.block_ids[:2] and s.block_ids[2] != first.block_ids[2]
        assert s.num_cached_tokens == 8 and s.prefix_parent is None
    assert siblings[0].block_ids[2] != siblings[1].block_ids[2]
    assert [sched.pool.blocks[x].ref_count for x in first.block_ids] == [3, 3, 1]
    assert other.num_cached_tokens == 0 and not set(other.block_ids) & set(first.block_ids)
    assert sched.prefix_hits == 16


# ----------------------------------------------------------------------------------------- abort
def test_abort_of_a_waiting_request_frees_nothing_and_drops_it_from_the_queue():
    sched = make_scheduler(free_blocks=20, budget=4)
    a, b = make_request(1, 4), make_request(2, 4)
    sched.add(a)
    sched.add(b)
    assert step(sched) == Plan(prefill=[(1, 0, 4)])
    free, slots = sched.pool.num_free, len(sched.batch._free_slots)
    sched.finish(b)
    assert b.status == Status.FINISHED and not sched.waiting
    assert sched.pool.num_free == free and len(sched.batch._free_slots) == slots
    assert step(sched) == Plan(decode=[1])


def test_abort_of_a_running_request_frees_exactly_its_blocks_and_slot():
    sched = make_scheduler(free_blocks=20, budget=32)
    a = make_request(1, prompt=PROMPT)
    sched.add(a)
    step(sched)
    b = make_request(2, prompt=PROMPT)  # shares a's two full blocks
    sched.add(b)
    step(sched)
    assert sched.pool.num_free == 20 - 3 - 1
    b_slot, b_own = b.slot, b.block_ids[2]
    sched.finish(b)
    # Only b's own block is free again; the shared ones lose a reference.
    assert sched.pool.num_free == 20 - 3 and free_list(sched.pool)[-1] == b_own
    assert [sched.pool.blocks[x].ref_count for x in a.block_ids] == [1, 1, 1]
    assert b.status == Status.FINISHED and b.slot == -1 and b.block_ids == []
    assert sched.batch.requests[b_slot] is None and ids(sched.running) == [1]
    assert step(sched) == Plan(decode=[1])
    # The freed slot is the next one handed out.
    c = make_request(3, 2)
    sched.add(c)
    step(sched)
    assert c.slot == b_slot
    sched.finish(a)
    sched.finish(c)
    assert sched.pool.num_free == 20 and not sched.running
    assert len(sched.batch._free_slots) == sched.batch.capacity


# ------------------------------------------------------- steady state == general walk (property)
def schedule_by_walk(sched: Scheduler) -> ScheduledBatch:
    """Scheduler.schedule with its running requests always planned by the general walk
    (_plan_with_preemption), which the real schedule() only uses when blocks run short, then
    schedule()'s own tail."""
    b, slots = sched.batch, sched._slots()
    decoding = (b.num_tokens[slots] - b.num_computed[slots] == 1).any()
    budget = sched.max_num_batched_tokens if decoding else sched.max_prefill_tokens
    granted, preempted = sched._plan_with_preemption(budget)
    return sched._schedule_from_plan(sched._slots(), granted, budget, preempted)


def describe(sched: Scheduler, out: ScheduledBatch) -> tuple:
    """A schedule and the state it left, by request id: what must match between the two paths."""
    b, pool = sched.batch, sched.pool
    return (
        [b.requests[s].request_id for s in out.decode_slots],
        [(c.request.request_id, c.start, c.length, c.samples) for c in out.prefills],
        out.sample_slots.tolist(),
        ids(out.preempted), ids(sched.running), ids(sched.waiting),
        [(r.slot, r.block_ids, b.block_table[r.slot, : b.num_blocks[r.slot]].tolist()) for r in sched.running],
        free_list(pool), [blk.ref_count for blk in pool.blocks], {k: blk.block_id for k, blk in pool.cached.items()},
        list(b._free_slots),
    )


def path_taken(sched: Scheduler) -> str:
    """Which branch of Scheduler.schedule this state takes (its conditions restated), for coverage."""
    b, slots = sched.batch, sched._slots()
    if not len(slots):
        return "admission only"
    remaining = b.num_tokens[slots] - b.num_computed[slots]
    if len(slots) <= sched.max_num_batched_tokens and (remaining == 1).all():
        grow = (b.num_blocks[slots] * sched.block_size == b.num_computed[slots]).sum()
        if grow <= sched.pool.num_free:
            return "steady state"
    return "vectorised"


def test_shortcut_plans_schedule_exactly_as_the_general_walk_when_nothing_is_preempted():
    # Scheduler.schedule plans the running batch three ways: the steady state (all decodes,
    # blocks suffice), a vectorised plan, and the walk that can preempt. The first two are
    # optimisations of the walk: whenever the walk preempts nothing they must give the same
    # schedule and leave the same state (block ids, free-list order, ref counts, prefix cache,
    # slots). Each engine state is scheduled twice: by the real schedule(), and by the walk on a
    # deep copy (copy.deepcopy of the scheduler takes its batch, pool and requests with it), so
    # both start from the same state and neither disturbs the other. States that preempt are
    # compared too: there schedule() runs the walk itself.
    seen = {"steady state": 0, "vectorised": 0, "preempting": 0, "admission only": 0}

    @settings(max_examples=150, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.data())
    def check(data):
        free_blocks = data.draw(st.integers(3, 20), "free blocks")
        budget = data.draw(st.integers(1, 16), "budget")
        sched = make_scheduler(free_blocks=free_blocks, budget=budget,
                               max_num_seqs=data.draw(st.integers(1, 6), "max_num_seqs"),
                               prefix_caching=data.draw(st.booleans(), "prefix caching"),
                               prefill_budget=budget + data.draw(st.integers(0, 16), "prefill budget above it"))
        # (arrival step, prompt length, max_tokens, prompt family, n): prompts of one family share
        # their prefix, so prefix hits happen.
        arrivals = data.draw(st.lists(st.tuples(st.integers(0, 10), st.integers(1, 24), st.integers(1, 12),
                                                st.integers(0, 2), st.integers(1, 2)), min_size=1, max_size=8),
                             "requests")
        next_id = 0
        for t in range(data.draw(st.integers(1, 30), "steps")):
            for arrive, prompt_len, max_tokens, family, n in arrivals:
                if arrive == t:
                    # Every request fits the whole pool, as EngineCore ensures through max_model_len
                    # (one that does not would wait forever).
                    prompt_len = min(prompt_len, free_blocks * BS - 1)
                    max_tokens = min(max_tokens, free_blocks * BS - prompt_len)
                    prompt = np.arange(2000 * family, 2000 * family + prompt_len, dtype=np.int32)
                    first = None
                    for _ in range(n):
                        req = make_request(next_id, prompt=prompt, max_tokens=max_tokens, n=n, parent=first)
                        first = first or req
                        next_id += 1
                        sched.add(req)
            if not sched.running and not sched.waiting:
                continue  # idle until the next arrival
            ref = copy.deepcopy(sched)
            expected = describe(ref, schedule_by_walk(ref))
            path = path_taken(sched)
            out = sched.schedule()
            seen["preempting" if out.preempted else path] += 1
            assert describe(sched, out) == expected, path
            run_step(sched, out, token=t % 3)

    check()
    # The comparison is only as good as the states it saw: each path must have come up often.
    assert seen["steady state"] >= 200 and seen["vectorised"] >= 100 and seen["preempting"] >= 20, seen
