"""What a draft's training starts from, before any weight exists: where the hidden states come
from, the draft's shape checked against them, the starting draft (train.init_from), the
vocabulary map and data index, and the plan's size. Every refusal about the data or the draft's
shape is raised here, before the model is built; a resume's refusals are tasks/draft/resume.py's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tasks.config import TrainConfig
from tasks.draft.architecture import DraftConfig
from tasks.draft.data import (
    DataIndex,
    SeqRef,
    SequenceReader,
    ShardReader,
    build_index,
    plan_epoch,
    rank_batches,
)
from tasks.draft.distributed import Dist
from tasks.draft.online import OnlineData, OnlineTarget
from tasks.draft.starting_draft import StartingDraft, read_starting_draft
from tasks.draft.vocab import VocabMap, build_vocab_map, count_tokens
from tasks.errors import ExpectedFailure
from tasks.runfolder import RunFolder
from tasks.runfolder.layout import TRAIN_VOCAB_MAP
from tasks.target.model_dir import read_model_config, resolve_model_dir


class TrainError(RuntimeError, ExpectedFailure):
    """Training cannot start: the extracted data does not fit the target or the config."""


def open_states(run: RunFolder, cfg: TrainConfig, online: OnlineTarget | None,
                device: torch.device) -> tuple[OnlineData | None, dict[str, Any]]:  # fmt: skip
    """Where the hidden states come from (online: the target capturing them on `device`; offline:
    the extract shards, None) and their metadata (aux layer ids, hidden size, held-out split)."""
    from tasks.extract.storage import extract_metadata

    if cfg.hidden_states != "online":
        return None, extract_metadata(run)
    if online is None:
        raise TrainError("train.hidden_states is 'online' but no OnlineTarget was given: pass "
                         "online=OnlineTarget.from_config(config) (the target and extract settings)")
    source = OnlineData(run, online, device)
    return source, source.metadata()


def draft_config_for(cfg: TrainConfig, target_path: str, data_meta: dict[str, Any]) -> DraftConfig:
    """The draft's shape for the target, refused when the stored states were taken elsewhere."""
    target_config = read_model_config(resolve_model_dir(target_path))
    draft_cfg = DraftConfig.from_target(target_config, cfg.draft_vocab_size, cfg.intermediate_size)
    stored_ids = [int(i) for i in data_meta.get("aux_layer_ids", [])]
    if stored_ids != draft_cfg.aux_layer_ids:
        raise TrainError(
            f"extracted aux layers {stored_ids} differ from the draft's "
            f"{draft_cfg.aux_layer_ids} for this target: re-extract or check the target path"
        )
    if int(data_meta.get("hidden_size", -1)) != draft_cfg.target_hidden_size:
        raise TrainError(
            f"extracted hidden_size {data_meta.get('hidden_size')} differs from the "
            f"target's {draft_cfg.target_hidden_size}"
        )
    return draft_cfg


def starting_draft(cfg: TrainConfig, draft_cfg: DraftConfig,
                   vocab_map: VocabMap | None) -> tuple[StartingDraft | None, VocabMap | None]:  # fmt: skip
    """train.init_from, read and checked before the data is indexed, and the vocabulary map the
    run then uses: the starting draft's (which must be the one a caller gave, if any)."""
    if not cfg.init_from:
        return None, vocab_map
    start = read_starting_draft(cfg.init_from, draft_cfg)
    if vocab_map is not None and not torch.equal(vocab_map.d2t, start.vocab.d2t):
        raise TrainError(f"train.init_from {start.source}: its vocabulary map is not the one this draft "
                         "was given (a scaling draft trains on its full draft's)")
    return start, start.vocab


def vocab_and_index(
    run: RunFolder, vocab_size: int, draft_vocab_size: int, rank: Dist, vocab_map: VocabMap | None = None,
    indexer: Callable[..., DataIndex] | None = None, max_train_sequences: int | None = None,
    train_subset: frozenset[str] | None = None,
) -> tuple[VocabMap, Any]:
    """The draft vocabulary map and the data index. Rank 0 indexes the data and, when neither
    `vocab_map` nor a saved map exists, counts the training split's loss-masked tokens in the
    same pass (eval sequences never count, nor those outside `train_subset`; past
    `max_train_sequences`, neither do the rest: the indexing visits them in index order, the order
    DataIndex.subset and .limited keep) and saves the map; the other ranks load both.
    `indexer(visit, use_cache=...)` indexes the data (default: the extract shards'). With a subset,
    an index cached before it held sequence ids is built again."""
    build = indexer or (lambda visit=None, use_cache=True: build_index(run, visit, use_cache))
    if rank.rank == 0:
        have_map = vocab_map is not None or run.exists(TRAIN_VOCAB_MAP)
        counted: list[tuple[torch.Tensor, torch.Tensor]] = []

        def visit(seq: Any) -> None:
            if seq.split != "train" or (train_subset is not None and seq.sequence_id not in train_subset):
                return
            if max_train_sequences is None or len(counted) < max_train_sequences:
                counted.append((seq.input_ids, seq.loss_mask))

        index = build(None if have_map else visit, use_cache=have_map)
        if train_subset is not None and any(not r.sequence_id for r in index.refs):
            index = build(None, use_cache=False)
        if vocab_map is None and not have_map:
            counts = count_tokens(counted, vocab_size)
            build_vocab_map(counts, draft_vocab_size).save(run)
        elif vocab_map is not None:
            vocab_map.save(run)
    rank.barrier()
    if rank.rank != 0:
        index = build()  # rank 0 has written the index with its ids by now
    return VocabMap.load(run), index


@dataclass
class TrainData:
    """The data a draft trains on, indexed and planned: what the loop, the evaluation and the
    checkpoints read of it."""

    run: RunFolder
    source: OnlineData | None  # online: the target capturing the states; offline: None
    meta: dict[str, Any]  # the states' metadata (extract's, or the online target's)
    index: DataIndex  # the training split cut to max_train_sequences
    vocab: VocabMap
    steps_per_epoch: int
    total_steps: int
    eval_batches: list[list[SeqRef]]  # this rank's held-out batches (eval_max_batches at most)

    def reader(self, compute_dtype: torch.dtype) -> SequenceReader:
        # Online, the captured states stay on the device in compute_dtype (OnlineReader).
        return self.source.reader(self.index, compute_dtype) if self.source else ShardReader(self.run, self.index)

    @property
    def train_sequences(self) -> int:
        return len(self.index.split("train"))

    def close(self) -> None:
        if self.source is not None:
            self.source.close()


def plan_data(run: RunFolder, cfg: TrainConfig, draft_cfg: DraftConfig, vocab: VocabMap, index: DataIndex,
              rank: Dist, eval_max_batches: int | None) -> tuple[int, int, list[list[SeqRef]]]:  # fmt: skip
    """Steps per epoch (this process's share of an epoch's batches), total steps and this rank's
    held-out batches; refused when the vocabulary map or the data does not fit the run."""
    if vocab.draft_vocab_size != draft_cfg.draft_vocab_size or vocab.vocab_size != draft_cfg.vocab_size:
        raise TrainError(
            f"{run.url}/{TRAIN_VOCAB_MAP}: vocab map of {vocab.draft_vocab_size}/{vocab.vocab_size} "
            f"tokens does not fit draft_vocab_size {draft_cfg.draft_vocab_size} / target vocab "
            f"{draft_cfg.vocab_size}"
        )
    train_plan_len = len(plan_epoch(index, "train", 0, cfg.seed, cfg.batch_tokens))
    steps_per_epoch = train_plan_len // rank.world
    if steps_per_epoch == 0:
        raise TrainError(
            f"{run.url}: {train_plan_len} training batches for {rank.world} processes; "
            "need at least one each (more data or a smaller batch_tokens)"
        )
    eval_batches = rank_batches(
        plan_epoch(index, "eval", 0, cfg.seed, cfg.batch_tokens, shuffle=False),
        rank.rank, rank.world, even=False,
    )[:eval_max_batches]
    return steps_per_epoch, cfg.max_steps or cfg.epochs * steps_per_epoch, eval_batches
