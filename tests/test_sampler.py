"""The sampler without a model: penalties, min_tokens bans and logprobs on hand-made logits."""

from __future__ import annotations

import torch

from leanserve.engine.sampler import Sampler, SamplingMetadata, _apply_penalties


def greedy_meta(rows: int, **kw) -> SamplingMetadata:
    return SamplingMetadata(temperature=torch.zeros(rows), all_greedy=True, **kw)


def test_penalties_follow_vllm_semantics_exactly():
    # Repetition (over prompt + output): positive logits divided, negative multiplied.
    # Presence and frequency (over the output only): minus presence once, minus frequency per use.
    logits = torch.tensor([[2.0, -1.0, 4.0, 3.0, 0.5]])
    prompt, output = torch.tensor([0, 1]), torch.tensor([3, 3, 4])
    meta = greedy_meta(1, penalties=[(0, prompt, output, 2.0, 0.5, 0.25)], max_num_logprobs=0)
    out = Sampler()(logits.clone(), meta)
    expected = torch.tensor([[2.0 / 2, -1.0 * 2, 4.0, 3.0 / 2 - 0.5 - 2 * 0.25, 0.5 / 2 - 0.5 - 0.25]])
    assert out.token_ids.tolist() == [2]
    # Logprobs are of the raw distribution: what the model said, before any penalty.
    assert torch.allclose(out.logprobs, torch.log_softmax(logits, -1)[0, 2:3])
    # The sampled token is the argmax of the penalised row; check the row itself too.
    row = logits[0].clone()
    _apply_penalties(row, prompt, output, 2.0, 0.5, 0.25)
    assert torch.allclose(row, expected[0])


def test_penalties_touch_only_their_own_row():
    logits = torch.tensor([[5.0, 1.0], [5.0, 1.0]])
    meta = greedy_meta(2, penalties=[(1, torch.tensor([0]), torch.tensor([0, 0]), 10.0, 2.0, 2.0)])
    assert Sampler()(logits, meta).token_ids.tolist() == [0, 1]


def test_banned_ids_cannot_be_sampled_but_keep_their_logprob_mass_out():
    # min_tokens: stop ids are masked before sampling, and before the logprobs are taken.
    logits = torch.tensor([[3.0, 2.0, 1.0]])
    out = Sampler()(logits.clone(), greedy_meta(1, banned=[(0, [0])], max_num_logprobs=1))
    assert out.token_ids.tolist() == [1]
    assert torch.allclose(out.logprobs, torch.log_softmax(torch.tensor([2.0, 1.0]), -1)[:1])
    assert out.top_ids.tolist() == [[1]]


def test_seeded_rows_draw_from_their_own_generator():
    # The same seed gives the same token whatever else is in the batch.
    logits = torch.zeros(3, 1000)

    def sample(seed_row: int) -> int:
        meta = SamplingMetadata(temperature=torch.ones(3), all_greedy=False, top_k=torch.zeros(3, dtype=torch.long),
                                top_p=torch.ones(3), min_p=torch.zeros(3),
                                generators={seed_row: torch.Generator().manual_seed(7)})
        return int(Sampler(seed=seed_row)(logits.clone(), meta).token_ids[seed_row])

    assert sample(0) == sample(2)
