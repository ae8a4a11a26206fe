"""Offline acceptance replay on hand-built sequences, with a real Eagle3Draft made to draft one
fixed token everywhere, so every cycle's outcome can be worked out by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tasks.draft.acceptance import replay_cycles, response_segments
from tasks.draft.architecture import DraftConfig
from tasks.draft.model import Eagle3Draft
from tasks.gate.replay import replay

Z = 42  # the token the draft always proposes
TARGET = {"model_type": "llama", "hidden_size": 16, "num_hidden_layers": 8, "vocab_size": 64,
          "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 32}  # fmt: skip


@pytest.fixture(scope="module")
def constant_draft() -> Eagle3Draft:
    """norm.weight = 0 makes every logit 0, so argmax is draft id 0 at every step and
    position; d2t[0] maps it to target token Z."""
    torch.manual_seed(0)
    draft = Eagle3Draft(DraftConfig.from_target(TARGET, 8, 32), torch.randn(64, 16))
    with torch.no_grad():
        draft.norm.weight.zero_()
        draft.d2t[0] = Z
    return draft


def sequence(sid: str, domain: str, prompt: list[int], response: list[int]) -> SimpleNamespace:
    ids = prompt + response
    g = torch.Generator().manual_seed(len(ids))
    return SimpleNamespace(
        sequence_id=sid, domain=domain, input_ids=torch.tensor(ids),
        loss_mask=torch.tensor([False] * len(prompt) + [True] * len(response)),
        aux_hidden=torch.randn(len(ids), 48, generator=g),
    )  # fmt: skip


# index:   0  1  2  3  4  5  6  7  8  9  10 11
SEQ_A = sequence("a", "math", [5, 6, 7], [9, Z, Z, Z, 9, Z, Z, 9, 9])
# index:   0  1  2  3  4   -- ends on accepted drafts: the last cycle has no bonus token
SEQ_B = sequence("b", "code", [5, 6], [9, Z, Z])


def test_response_segments():
    mask = torch.tensor([0, 0, 1, 1, 0, 1, 0, 1, 1, 1], dtype=torch.bool)
    assert response_segments(mask) == [(2, 3), (5, 5), (7, 9)]
    # A response at index 0 has no prompt state to draft from; it is skipped.
    assert response_segments(torch.tensor([1, 1, 0, 1], dtype=torch.bool)) == [(3, 3)]
    assert response_segments(torch.zeros(4, dtype=torch.bool)) == []


def test_cycles_by_hand():
    # matches[j, t]: the draft's step-j token at index t equals the token at t + 2 + j.
    matches = torch.zeros(3, 12, dtype=torch.bool)
    matches[0, 2] = matches[1, 2] = True  # from c = 3: tokens 4 and 5 drafted right, 6 wrong
    matches[0, 5] = True  # from c = 6: token 7 right, 8 wrong
    assert replay_cycles(matches, [(3, 11)], 3) == ([3, 2, 1, 1, 1], [2, 1, 0, 0, 0])
    assert replay_cycles(matches, [(3, 11)], 1) == ([2, 1, 2, 1, 1, 1], [1, 0, 1, 0, 0, 0])


def test_replay_counts_every_cycle(constant_draft: Eagle3Draft):
    result = replay(constant_draft, [SEQ_A, SEQ_B], (1, 3), n_bootstrap=500, seed=7)
    a, b = result.sequences
    # SEQ_A, k=1: from x3 draft Z (x4 = Z, accepted) + bonus; from x5: x6 = Z; from x7: x8 = Z;
    # from x9: x10 = 9, rejected; from x10: x11 = 9, rejected.
    assert a.emitted[1] == [2, 2, 2, 1, 1] and a.accepted[1] == [1, 1, 1, 0, 0]
    # k=3: from x3: Z Z Z all accepted + bonus x7; from x7: Z Z accepted, 9 rejected; from x10: rejected.
    assert a.emitted[3] == [4, 3, 1] and a.accepted[3] == [3, 2, 0]
    # SEQ_B, k=3: from x2 the two remaining tokens are accepted drafts; no bonus past the end.
    assert b.emitted[3] == [2] and b.accepted[3] == [2]
    assert b.emitted[1] == [2] and b.accepted[1] == [1]

    overall = result.overall[3]
    assert (overall["tokens"], overall["cycles"], overall["sequences"]) == (10, 4, 2)
    assert overall["accept_length"] == pytest.approx(10 / 4)
    assert overall["accept_per_position"] == pytest.approx([3 / 4, 3 / 4, 1 / 4])
    # Bootstrap over sequences: the CI lies between the per-sequence ratios (2.0 and 8/3).
    assert 2.0 <= overall["ci_low"] <= overall["accept_length"] <= overall["ci_high"] <= 8 / 3
    assert result.accept_lengths() == pytest.approx({1: 10 / 6, 3: 10 / 4})
    assert result.accept_lengths("math") == pytest.approx({1: 8 / 5, 3: 8 / 3})
    assert result.per_domain["code"][3]["ci_low"] == result.per_domain["code"][3]["ci_high"] == 2.0

    again = replay(constant_draft, [SEQ_A, SEQ_B], (1, 3), n_bootstrap=500, seed=7)
    assert again.to_dict() == result.to_dict()  # seeded
    assert set(result.to_dict()) == {"num_steps", "overall", "per_domain", "settings", "per_sequence"}
    assert list(result.to_dict()["overall"]) == ["1", "3"]


def test_a_replay_pooled_again_over_a_subset_of_its_sequences(constant_draft: Eagle3Draft):
    """replay.json keeps each sequence's tokens and cycles per num_steps, so that the sequences
    another run also held out can be pooled alone (replayed_on): over all of them it is the
    replay's own figure and CI, over one it is that sequence's replay."""
    from tasks.gate.replay import replayed_on

    seq_c = sequence("c", "code", [5, 6, 7, 8], [Z, 9, Z, Z, Z, 9])
    result = replay(constant_draft, [SEQ_A, SEQ_B, seq_c], (1, 3), n_bootstrap=500, seed=7).to_dict()
    assert result["per_sequence"][0] == {"sequence_id": "a", "domain": "math", "tokens": {"1": 8, "3": 8},
                                         "cycles": {"1": 5, "3": 3}}  # fmt: skip
    whole = replayed_on(result, {"a", "b", "c"}, 3)
    assert whole == {k: v for k, v in result["overall"]["3"].items() if k != "accept_per_position"}
    alone = replay(constant_draft, [SEQ_A, seq_c], (3,), n_bootstrap=500, seed=7).overall[3]
    shared = replayed_on(result, {"a", "c", "not replayed"}, 3)
    assert shared["accept_length"] == alone["accept_length"] and shared["sequences"] == 2
    assert shared["accept_length"] != whole["accept_length"]
    assert replayed_on(result, {"a"}, 2) is None  # not replayed at 2 steps
    assert replayed_on({k: v for k, v in result.items() if k != "per_sequence"}, {"a"}, 3) is None  # an older replay


def test_replay_refuses_bad_input(constant_draft: Eagle3Draft):
    narrow = SimpleNamespace(**{**vars(SEQ_A), "sequence_id": "narrow", "aux_hidden": torch.zeros(12, 32)})
    with pytest.raises(ValueError, match=r"sequence narrow: aux_hidden is 32 wide, the draft's fc takes 48"):
        replay(constant_draft, [narrow], (1,))
    with pytest.raises(ValueError, match="num_steps must be integers >= 1"):
        replay(constant_draft, [SEQ_A], (0, 2))
    prompt_only = sequence("p", "math", [5, 6, 7], [])
    empty = replay(constant_draft, [prompt_only], (2,), n_bootstrap=100).overall[2]
    assert (empty["accept_length"], empty["cycles"], empty["sequences"]) == (None, 0, 1)
