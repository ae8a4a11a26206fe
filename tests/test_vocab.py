"""The draft vocabulary map: top-N under the loss mask, d2t/t2d, padding, coverage, save/load."""

from __future__ import annotations

import pytest
import torch

from tasks.draft.vocab import (
    VocabMap,
    build_vocab_map,
    count_tokens,
    vocab_consistency_problems,
)
from tasks.runfolder import RunFolder
from tasks.runfolder.layout import TRAIN_VOCAB_MAP


def _seq(ids: list[int], mask: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.bool)


def test_counts_only_loss_masked_tokens() -> None:
    # Token 9 dominates the prompt side but is never under the mask: it must not count.
    seqs = [
        _seq([9, 9, 9, 9, 3, 4, 3], [0, 0, 0, 0, 1, 1, 1]),
        _seq([9, 9, 5, 3], [0, 0, 1, 1]),
    ]
    counts = count_tokens(seqs, vocab_size=12)
    assert counts.dtype == torch.int64
    assert counts.tolist() == [0, 0, 0, 3, 1, 1, 0, 0, 0, 0, 0, 0]


def test_counts_in_chunks_are_the_counts_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens are counted a chunk of COUNT_CHUNK_TOKENS at a time (not one vocabulary-sized
    bincount a sequence, nor all tokens at once): any chunk size gives the same counts."""
    import tasks.draft.vocab as vocab

    g = torch.Generator().manual_seed(0)
    seqs = [_seq(torch.randint(0, 50, (n,), generator=g).tolist(), torch.randint(0, 2, (n,), generator=g).tolist())
            for n in (7, 1, 30, 12, 5, 0, 19)]  # fmt: skip
    expected = torch.zeros(50, dtype=torch.int64)
    for ids, mask in seqs:
        for t in ids[mask].tolist():
            expected[t] += 1
    for chunk in (1, 3, 10, 1 << 24):
        monkeypatch.setattr(vocab, "COUNT_CHUNK_TOKENS", chunk)
        assert torch.equal(count_tokens(seqs, 50), expected), chunk


def test_top_n_under_mask_excludes_unmasked_frequent_token() -> None:
    seqs = [_seq([9] * 50 + [3, 3, 3, 4, 4, 5], [0] * 50 + [1] * 6)]
    vmap = build_vocab_map(count_tokens(seqs, 12), draft_vocab_size=2)
    assert vmap.draft_ids.tolist() == [3, 4]
    assert not bool(vmap.t2d[9])


def test_ties_break_to_lower_id_and_ids_ascend() -> None:
    counts = torch.zeros(20, dtype=torch.int64)
    counts[[17, 2, 11, 6]] = torch.tensor([5, 5, 9, 5])
    vmap = build_vocab_map(counts, draft_vocab_size=3)
    # 11 (count 9) first, then the lowest two of the tied {2, 6, 17}.
    assert vmap.draft_ids.tolist() == [2, 6, 11]
    assert vmap.d2t.tolist() == [2, 5, 9]
    assert vmap.d2t.dtype == torch.int64


def test_d2t_and_t2d_agree() -> None:
    gen = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 100, (500,), generator=gen)
    vmap = build_vocab_map(counts, draft_vocab_size=64)
    index = torch.arange(64)
    assert torch.equal(vmap.t2d.nonzero().flatten(), index + vmap.d2t)
    assert int(vmap.t2d.sum()) == 64 and vmap.t2d.dtype == torch.bool
    assert vocab_consistency_problems(vmap.d2t, vmap.t2d) == []
    # Round trip through both directions.
    assert torch.equal(vmap.target_to_draft(vmap.draft_to_target(index)), index)
    outside = (~vmap.t2d).nonzero().flatten()[:5]
    assert vmap.target_to_draft(outside).tolist() == [-1] * 5


def test_padding_with_lowest_unused_ids() -> None:
    counts = torch.zeros(10, dtype=torch.int64)
    counts[[7, 4]] = torch.tensor([3, 1])
    vmap = build_vocab_map(counts, draft_vocab_size=5)
    assert vmap.draft_ids.tolist() == [0, 1, 2, 4, 7]
    assert vmap.stats["padded"] == 3
    assert vmap.stats["distinct_tokens_seen"] == 2


def test_draft_vocab_capped_at_target_vocab() -> None:
    vmap = build_vocab_map(torch.ones(6, dtype=torch.int64), draft_vocab_size=32000)
    assert vmap.draft_vocab_size == 6
    assert vmap.d2t.tolist() == [0] * 6
    assert vmap.stats["requested_draft_vocab_size"] == 32000


def test_coverage_arithmetic_exact() -> None:
    counts = torch.zeros(8, dtype=torch.int64)
    counts[[1, 2, 3, 5]] = torch.tensor([10, 7, 2, 1])
    vmap = build_vocab_map(counts, draft_vocab_size=2)
    assert vmap.stats["masked_tokens"] == 20
    assert vmap.stats["covered_tokens"] == 17
    assert vmap.stats["coverage"] == 17 / 20
    assert vmap.stats["padded"] == 0


def test_save_load_round_trip(tmp_path) -> None:
    run = RunFolder(str(tmp_path / "run"))
    counts = torch.arange(30, dtype=torch.int64) % 7
    vmap = build_vocab_map(counts, draft_vocab_size=9)
    vmap.save(run)
    assert run.exists("train/vocab_map.safetensors")
    back = VocabMap.load(run)
    assert torch.equal(back.d2t, vmap.d2t) and torch.equal(back.t2d, vmap.t2d)
    assert torch.equal(back.draft_ids, vmap.draft_ids)
    assert back.stats == vmap.stats


def test_load_refuses_inconsistent_map(tmp_path) -> None:
    run = RunFolder(str(tmp_path / "run"))
    vmap = build_vocab_map(torch.arange(10, dtype=torch.int64), draft_vocab_size=4)
    broken = VocabMap(d2t=vmap.d2t.clone(), t2d=vmap.t2d.clone(), draft_ids=vmap.draft_ids, stats={})
    broken.t2d[0] = True
    broken.save(run, "train/bad.safetensors")
    with pytest.raises(ValueError, match=r"bad\.safetensors.*t2d marks 5 target tokens but d2t has 4"):
        VocabMap.load(run, "train/bad.safetensors")


def test_out_of_range_token_named() -> None:
    with pytest.raises(ValueError, match=r"sequence 1: token id 12 is outside"):
        count_tokens([_seq([1, 2], [1, 1]), _seq([3, 12], [0, 1])], vocab_size=12)
    # Out of range but unmasked is fine: it never counts.
    assert int(count_tokens([_seq([3, 12], [1, 0])], 12).sum()) == 1


def test_the_trainer_counts_the_training_split_only(tmp_path) -> None:
    """Real extract shard (its writer, the commit protocol), through the trainer's own pass
    (index and counts together): eval tokens never count."""
    import pyarrow as pa

    from tasks.draft.trainer import Dist, vocab_and_index
    from tasks.extract.local_capture import CapturedStates
    from tasks.extract.sequences import TrainingSequence
    from tasks.extract.storage import ShardWriter
    from tasks.runfolder import ShardCommit, ShardStore

    run = RunFolder(str(tmp_path / "run"))
    hidden, vocab = 8, 40
    writer = ShardWriter(hidden, [1, 3, 4], "bf16")
    rows = [
        ("r0", "train", [1, 2, 7, 7, 7, 9], [0, 0, 1, 1, 1, 1]),
        ("r1", "eval", [1, 2, 30, 30, 30, 30], [0, 0, 1, 1, 1, 1]),
        ("r2", "train", [2, 2, 9, 5], [1, 0, 1, 1]),
    ]
    for rid, split, ids, mask in rows:
        seq = TrainingSequence(rid, "p" + rid, "chat", split, ids, mask, False)
        writer.add(seq, CapturedStates(aux=torch.zeros(len(ids), 3 * hidden), last=torch.zeros(len(ids), hidden)))
    dead = pa.Table.from_pylist([], schema=pa.schema([("request_id", pa.string())]))
    keys = [r[0] for r in rows]
    shard = ShardCommit("s0", "a", "fp", keys, dead)
    ShardStore(run, "extract").commit_payload(writer.to_bytes(), "safetensors", keys, shard)
    vmap, index = vocab_and_index(run, vocab, 3, Dist.current())
    assert run.exists(TRAIN_VOCAB_MAP) and index is not None
    # train masked tokens: 7,7,7,9 and 2,9,5 -> counts 7:3, 9:2, 2:1, 5:1 (tie 2 < 5); 30 is eval only.
    assert vmap.draft_ids.tolist() == [2, 7, 9]
    assert (vmap.stats["masked_tokens"], vmap.stats["covered_tokens"]) == (7, 6)
    assert not bool(vmap.t2d[30])
