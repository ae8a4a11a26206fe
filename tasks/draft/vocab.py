"""The draft vocabulary: the most frequent target tokens under the loss mask (docs/DESIGN.md §7).

The draft's lm_head only scores `draft_vocab_size` tokens. SGLang maps a draft id back to
the target vocabulary as `target = i + d2t[i]`, so d2t holds int64 offsets, and `t2d`
marks (bool over the target vocabulary) which target tokens the draft can propose.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from tasks.runfolder import RunFolder
from tasks.runfolder.layout import TRAIN_VOCAB_MAP

FORMAT_VERSION = "1"


def count_tokens(seqs: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int) -> torch.Tensor:
    """Occurrences of each target token id where loss_mask is True (int64 [vocab_size]).

    Tokens outside the mask (prompt, template) never count: the draft only has to
    propose what the target generates.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    pending: list[torch.Tensor] = []
    held = 0
    for index, (input_ids, loss_mask) in enumerate(seqs):
        if input_ids.shape != loss_mask.shape or input_ids.dim() != 1:
            raise ValueError(
                f"sequence {index}: input_ids {tuple(input_ids.shape)} and loss_mask "
                f"{tuple(loss_mask.shape)} must be 1-D and the same length"
            )
        ids = input_ids[loss_mask.to(torch.bool)].to(torch.int64)
        if ids.numel() == 0:
            continue
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"sequence {index}: token id {bad} is outside the target vocabulary [0, {vocab_size})")
        pending.append(ids)
        held += ids.numel()
        if held >= COUNT_CHUNK_TOKENS:
            counts += torch.bincount(torch.cat(pending), minlength=vocab_size)
            pending, held = [], 0
    if pending:
        counts += torch.bincount(torch.cat(pending), minlength=vocab_size)
    return counts


# Tokens counted by one bincount: one a sequence allocated and added a vocabulary-sized array
# each time (151,936 for Qwen2.5: 6.2 s over 38,873 sequences, 0.6 s so: BENCHMARKS P25); one
# over everything would hold every token at once (8 bytes each: GBs at a million sequences).
COUNT_CHUNK_TOKENS = 1 << 24


def vocab_consistency_problems(d2t: torch.Tensor, t2d: torch.Tensor) -> list[str]:
    """Why d2t and t2d do not describe the same draft vocabulary ([] when they do)."""
    problems = []
    if d2t.dtype != torch.int64 or d2t.dim() != 1:
        problems.append(f"d2t must be int64 [draft_vocab], got {d2t.dtype} {tuple(d2t.shape)}")
    if t2d.dtype != torch.bool or t2d.dim() != 1:
        problems.append(f"t2d must be bool [vocab], got {t2d.dtype} {tuple(t2d.shape)}")
    if problems:
        return problems
    targets = torch.arange(d2t.numel(), dtype=torch.int64) + d2t
    marked = t2d.nonzero().flatten()
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= t2d.numel()):
        problems.append(f"d2t maps draft ids outside the target vocabulary [0, {t2d.numel()})")
    elif marked.numel() != targets.numel():
        problems.append(f"t2d marks {marked.numel()} target tokens but d2t has {targets.numel()} draft ids")
    elif not torch.equal(marked, targets):
        first = int((marked != targets).nonzero()[0])
        problems.append(
            f"d2t and t2d disagree at draft id {first}: d2t gives target {int(targets[first])}, "
            f"t2d's {first}-th marked token is {int(marked[first])} (draft ids must map to "
            f"ascending target ids)"
        )
    return problems


@dataclass
class VocabMap:
    """Draft id i <-> target id draft_ids[i] = i + d2t[i]."""

    d2t: torch.Tensor
    t2d: torch.Tensor
    draft_ids: torch.Tensor
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.numel())

    @property
    def vocab_size(self) -> int:
        return int(self.t2d.numel())

    def target_to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids for target ids, -1 where the target token is not in the draft vocabulary."""
        lookup = torch.full((self.vocab_size,), -1, dtype=torch.int64)
        lookup[self.draft_ids] = torch.arange(self.draft_vocab_size, dtype=torch.int64)
        return lookup[target_ids.to(torch.int64)]

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        ids = draft_ids.to(torch.int64)
        return ids + self.d2t[ids]

    def to_bytes(self) -> bytes:
        metadata = {"format_version": FORMAT_VERSION, "stats": json.dumps(self.stats, sort_keys=True)}
        return st_save({"d2t": self.d2t.contiguous(), "t2d": self.t2d.contiguous()}, metadata=metadata)

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "vocab map") -> VocabMap:
        tensors = st_load(data)
        missing = {"d2t", "t2d"} - set(tensors)
        if missing:
            raise ValueError(f"{where}: missing tensors {sorted(missing)}")
        stats = json.loads(_read_metadata(data).get("stats", "{}"))
        return cls.from_tensors(tensors["d2t"], tensors["t2d"], where, stats)

    @classmethod
    def from_tensors(cls, d2t: torch.Tensor, t2d: torch.Tensor, where: str = "vocab map",
                     stats: dict[str, Any] | None = None) -> VocabMap:  # fmt: skip
        """The map of a d2t / t2d pair (a saved map's, or an exported draft's), checked."""
        d2t, t2d = d2t.to(torch.int64), t2d.to(torch.bool)
        problems = vocab_consistency_problems(d2t, t2d)
        if problems:
            raise ValueError(f"{where}: " + "; ".join(problems))
        draft_ids = torch.arange(d2t.numel(), dtype=torch.int64) + d2t
        return cls(d2t=d2t, t2d=t2d, draft_ids=draft_ids, stats=stats or {})

    def save(self, run: RunFolder, rel: str = TRAIN_VOCAB_MAP) -> None:
        run.write_bytes_atomic(rel, self.to_bytes())

    @classmethod
    def load(cls, run: RunFolder, rel: str = TRAIN_VOCAB_MAP) -> VocabMap:
        return cls.from_bytes(run.read_bytes(rel), where=f"{run.url}/{rel}")


def _read_metadata(data: bytes) -> dict[str, str]:
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    return header.get("__metadata__", {}) or {}


def build_vocab_map(counts: torch.Tensor, draft_vocab_size: int) -> VocabMap:
    """The `draft_vocab_size` most frequent tokens (capped at the target vocabulary).

    Ties go to the lower token id. When fewer distinct tokens occur than the draft
    vocabulary holds, the rest is filled with the lowest unused target ids, so the map is
    deterministic and the draft keeps its configured width.
    """
    if counts.dim() != 1 or counts.numel() == 0:
        raise ValueError(f"counts must be a non-empty 1-D tensor over the target vocabulary, got {tuple(counts.shape)}")
    if draft_vocab_size < 1:
        raise ValueError(f"draft_vocab_size must be >= 1, got {draft_vocab_size}")
    counts = counts.to(torch.int64)
    if int(counts.min()) < 0:
        raise ValueError("counts must be non-negative")
    vocab_size = counts.numel()
    size = min(draft_vocab_size, vocab_size)
    # A stable descending sort keeps equal counts in ascending id order: that is both the
    # tie-break and, for the zero-count tail, the "lowest unused ids" padding.
    order = torch.sort(counts, descending=True, stable=True).indices
    draft_ids = torch.sort(order[:size]).values
    d2t = draft_ids - torch.arange(size, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    total = int(counts.sum())
    covered = int(counts[draft_ids].sum())
    distinct = int((counts > 0).sum())
    stats = {
        "target_vocab_size": vocab_size,
        "draft_vocab_size": size,
        "requested_draft_vocab_size": draft_vocab_size,
        "masked_tokens": total,
        "covered_tokens": covered,
        "coverage": covered / total if total else 0.0,
        "distinct_tokens_seen": distinct,
        "padded": max(0, size - distinct),
    }
    return VocabMap(d2t=d2t, t2d=t2d, draft_ids=draft_ids, stats=stats)
