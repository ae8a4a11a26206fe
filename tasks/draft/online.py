"""Online hidden states (`train.hidden_states: online`): the trainer runs the target over each
batch instead of reading the extract stage's shards, so no state is ever stored.

The two modes train on the same sequences, in the same order, on the same numbers:
- the sequences come from the committed generation shards through extraction's own
  SequenceBuilder (the chat-template check, the eval split, dead letters, truncation at
  extract.max_length), indexed in the order extraction writes them (shard id, then
  request_id), so `plan_epoch` draws the same batches from either index;
- the states are captured by extraction's LocalCapture (the same aux layers, the same
  decoder-only forward, the target in extract.dtype, loaded once per training process on
  its device) and passed through the storage encoding of extract.storage_dtype, so the draft
  sees exactly what it would have read back from a shard.
A generation shard is one index unit (data part 0). Offline, a shard whose states exceed
extract.part_bytes is split into several units, and from there on the epoch plans of the two
modes differ (the same sequences, other batches); with one part per shard they are equal.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tasks.draft.data import DATA_META_KEY, DataIndex, SeqRef
from tasks.extract.sequences import holdout_changed
from tasks.extract.storage import AUX_LAYERS, ExtractedSequence, SequenceTokens
from tasks.extract.writer import storage_round_trip
from tasks.runfolder import RunFolder, ShardStore

if TYPE_CHECKING:
    from tasks.config import EagleScaleConfig
    from tasks.extract.local_capture import LocalCapture
    from tasks.extract.sequences import TrainingSequence


class OnlineDataError(ValueError):
    """The generation data, or the held-out split made from it, changed under an online
    training run or its draft's replay (the train entry point, tasks/train/main.py, reports a
    ValueError as a one-line error)."""


@dataclass(frozen=True)
class OnlineTarget:
    """What online training needs beyond TrainConfig: the target and extraction's settings
    (the same keys an offline run would have extracted with)."""

    model_path: str
    revision: str | None
    chat_template: str | None
    max_length: int
    eval_fraction: float
    seed: int
    dtype: str
    storage_dtype: str
    batch_size: int
    holdout_unit: str

    @classmethod
    def from_config(cls, cfg: EagleScaleConfig) -> OnlineTarget | None:
        """The run's online settings, or None when it trains on extracted states."""
        return cls.of(cfg) if cfg.train.hidden_states == "online" else None

    @classmethod
    def of(cls, cfg: EagleScaleConfig) -> OnlineTarget:
        ex = cfg.extract
        return cls(cfg.target.model_path, cfg.target.revision, cfg.target.chat_template,
                   ex.max_length, ex.eval_fraction, ex.seed, ex.dtype, ex.storage_dtype,
                   ex.batch_size, ex.holdout_unit)  # fmt: skip


class OnlineData:
    """The training sequences of a run's committed generation shards and the target that
    turns them into states, for one training process."""

    def __init__(self, run: RunFolder, target: OnlineTarget, device: torch.device) -> None:
        from tasks.extract.backends import target_layout
        from tasks.extract.capture import aux_capture_layers
        from tasks.extract.sequences import SequenceBuilder
        from tasks.target.tokenizer import load_tokenizer

        self.run, self.target, self.device = run, target, device
        self.layout = target_layout(target.model_path, target.revision)
        self.aux_layer_ids = aux_capture_layers(self.layout.model_type, self.layout.num_layers)
        tokenizer = load_tokenizer(target.model_path, target.chat_template, revision=target.revision)
        # Refuses a chat template other than generation's, as extraction does.
        self.builder = SequenceBuilder(run, tokenizer, target.max_length, self.layout.vocab_size,
                                       target.eval_fraction, target.seed, target.holdout_unit)  # fmt: skip
        self.gen = ShardStore(run, "generate")
        self._capture: LocalCapture | None = None
        self._load_lock = threading.Lock()

    def metadata(self) -> dict[str, Any]:
        """The fields the trainer checks extract_metadata's against, for the states made here."""
        return {"hidden_size": self.layout.hidden_size, "aux_layer_ids": list(self.aux_layer_ids),
                "storage_dtype": self.target.storage_dtype, "holdout": self.builder.holdout}  # fmt: skip

    def shard_sequences(self, shard_id: str, marker: dict[str, Any]) -> list[TrainingSequence]:
        return self.builder.build(self.gen.read_rows(marker)).sequences

    def index(self, visit: Callable[[Any], None] | None = None, use_cache: bool = True) -> DataIndex:
        """Every committed generation shard's sequences (lengths and splits), built afresh:
        a process tokenizes the prompts once here (nothing is cached in the run folder, so no
        stale index can outlive a re-generated shard). `use_cache` is build_index's, unused."""
        del use_cache
        markers = dict(sorted(self.gen.committed().items()))
        if not markers:
            raise FileNotFoundError(f"{self.run.url}: no committed generation shards to train on online")
        refs = []
        for shard_id, marker in markers.items():
            for i, seq in enumerate(self.shard_sequences(shard_id, marker)):
                refs.append(SeqRef(shard_id, 0, i, len(seq.input_ids), seq.split, seq.sequence_id))
                if visit is not None:
                    visit(SequenceTokens(seq.sequence_id, seq.domain, seq.split, torch.tensor(seq.input_ids),
                                         torch.tensor(seq.loss_mask, dtype=torch.bool)))  # fmt: skip
        return DataIndex(markers, refs)

    @property
    def capture(self) -> LocalCapture:
        # Loaded on the first batch (the index and vocabulary map come first), once per process;
        # the batch thread and the evaluation may both ask.
        with self._load_lock:
            if self._capture is None:
                from tasks.extract.local_capture import LocalCapture
                from tasks.target.model_dir import resolve_model_dir

                model_dir = resolve_model_dir(self.target.model_path, self.target.revision)
                self._capture = LocalCapture.from_pretrained(
                    str(model_dir), self.aux_layer_ids, str(self.device), self.target.dtype,
                    self.target.batch_size,
                )  # fmt: skip
            return self._capture

    def reader(self, index: DataIndex, states_dtype: torch.dtype | None = None) -> OnlineReader:
        return OnlineReader(self, index, states_dtype)

    def close(self) -> None:
        if self._capture is not None:
            self._capture.close()
            self._capture = None


def online_sequences(
    run: RunFolder, target: OnlineTarget, device: torch.device, split: str, limit: int | None = None
) -> Iterator[ExtractedSequence]:
    """The first `limit` sequences of `split` with their states, in index order: the ones
    `iter_extracted(run, split)` would yield offline (the gate's replay of an online run).
    The target is loaded on the first and released after the last."""
    data = OnlineData(run, target, device)
    try:
        # The split the draft trained with (its data.json): another one would replay sequences it
        # trained on as held out.
        trained = run.read_json(DATA_META_KEY) or {}
        changed = holdout_changed(trained.get("holdout"), data.builder, f"{run.url}/{DATA_META_KEY}: the draft")
        if changed:
            raise OnlineDataError(changed)
        index = data.index()
        refs = index.split(split)[:limit]
        reader = data.reader(index)
        chunk = target.batch_size * 8  # like extraction's capture chunks: length bucketing
        for start in range(0, len(refs), chunk):
            yield from reader.batch(refs[start : start + chunk])
    finally:
        data.close()


class OnlineReader:
    """A SequenceReader that captures each batch's states with the target; keeps one
    generation shard's built sequences (token ids only) in memory at a time.

    `states_dtype` None: the states as a ShardReader returns them, host float32. Else they stay
    on the target's device, cast to that dtype (the trainer's compute dtype: what its step casts
    them to anyway, so the values are the same): a GPU trainer then never copies a batch's
    states to the host and back (a 0.24 s step ran at a 0.45 s pace, the rest the batch
    thread's copies, padding and pinning of ~400 MB of float32 a batch: BENCHMARKS P26)."""

    def __init__(self, data: OnlineData, index: DataIndex, states_dtype: torch.dtype | None = None) -> None:
        self.data, self.index, self.states_dtype = data, index, states_dtype
        self._unit: str | None = None
        self._seqs: list[TrainingSequence] = []

    def _sequence(self, ref: SeqRef) -> TrainingSequence:
        if ref.shard_id != self._unit:
            self._seqs = self.data.shard_sequences(ref.shard_id, self.index.markers[ref.shard_id])
            self._unit = ref.shard_id
        seq = self._seqs[ref.index] if ref.index < len(self._seqs) else None
        if seq is None or len(seq.input_ids) != ref.length or seq.split != ref.split:
            raise OnlineDataError(
                f"{self.data.run.url}/generate shard {ref.shard_id}: sequence {ref.index} no longer "
                f"matches the index built when training started (length {ref.length}, "
                f"{ref.split}); was the shard re-generated? Restart training"
            )
        return seq

    def batch(self, refs: list[SeqRef]) -> list[ExtractedSequence]:
        seqs = [self._sequence(r) for r in refs]
        states = self.data.capture.capture([s.input_ids for s in seqs])
        storage = self.data.target.storage_dtype

        def handed(x: torch.Tensor, groups: int) -> torch.Tensor:
            stored = storage_round_trip(x, storage, groups)  # float32, where the capture ran
            return stored.cpu() if self.states_dtype is None else stored.to(self.states_dtype)

        return [
            ExtractedSequence(
                sequence_id=s.sequence_id,
                domain=s.domain,
                split=s.split,
                input_ids=torch.tensor(s.input_ids, dtype=torch.int64),
                loss_mask=torch.tensor(s.loss_mask, dtype=torch.bool),
                aux_hidden=handed(st.aux, AUX_LAYERS),
                last_hidden=handed(st.last, 1),
            )
            for s, st in zip(seqs, states, strict=True)
        ]
