"""Training data from the committed extract shards: an index, seeded epoch plans, batches.

The plan is a pure function of (index, epoch, seed, batch_tokens), so the data-loader
position is just (epoch, batch number) and a resumed run sees exactly the batches the
interrupted one would have. Batches hold sequences of similar length (sorted within a shard),
right-padded, up to `batch_tokens` padded tokens; a longer sequence is a batch of its own.
The unit of reading is a shard's data part (a shard is one or more parts, see
tasks.runfolder.parts): parts are read one at a time (in a shuffled order per epoch) and
batches never span two of them, so memory holds one decoded part, not a shard or the data
set. Under DDP every rank walks the same plan and takes every
world-th batch; each rank gets the same number of steps.
"""

from __future__ import annotations

import queue
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tasks.draft.ttt import Batch
from tasks.runfolder import RunFolder, ShardStore, marker_parts
from tasks.runfolder.layout import TRAIN_DATA

STAGE = "extract"
INDEX_KEY = "train/data_index.json"
# Where the trained-on states came from, for export, the gate and the scaling drafts: online
# runs have no extract shards to ask.
DATA_META_KEY = TRAIN_DATA


@dataclass(frozen=True)
class SeqRef:
    shard_id: str
    part: int  # data part of the shard
    index: int  # position within the part
    length: int
    split: str
    sequence_id: str = ""  # the generation row's request_id ("" in an index cached before ids were)


@dataclass
class DataIndex:
    markers: dict[str, dict[str, Any]]  # shard_id -> extract marker
    refs: list[SeqRef]

    def split(self, split: str) -> list[SeqRef]:
        return [r for r in self.refs if r.split == split]

    def tokens(self, split: str) -> int:
        return sum(r.length for r in self.refs if r.split == split)

    def subset(self, split: str, sequence_ids: frozenset[str] | None) -> DataIndex:
        """Only the sequences of `split` in `sequence_ids` (index order kept); other splits
        untouched. For drafts trained on a chosen part of the data (by source kind, say), on the
        same held-out set."""
        if sequence_ids is None:
            return self
        if any(not r.sequence_id for r in self.refs if r.split == split):
            raise ValueError("the data index holds no sequence ids (cached before it did): index it again")
        return DataIndex(self.markers, [r for r in self.refs if r.split != split or r.sequence_id in sequence_ids])

    def limited(self, split: str, max_sequences: int | None) -> DataIndex:
        """Only the first `max_sequences` of `split` (index order); other splits untouched.
        For data-scaling runs: the same held-out set, less training data."""
        if max_sequences is None:
            return self
        kept, refs = 0, []
        for ref in self.refs:
            if ref.split == split:
                if kept >= max_sequences:
                    continue
                kept += 1
            refs.append(ref)
        return DataIndex(self.markers, refs)


def build_index(
    run: RunFolder, visit: Callable[[Any], None] | None = None, use_cache: bool = True
) -> DataIndex:
    """Index the committed extract shards (lengths and splits per part), cached in train/.

    A shard's tokens are read (part by part; its states are neither copied nor dequantized)
    only when the cache lacks its parts' sha256s; `visit(seq)` sees each SequenceTokens (the
    vocab count rides on this pass). `use_cache=False` reads all.
    """
    from tasks.extract.storage import iter_shard_tokens

    store = ShardStore(run, STAGE)
    markers = dict(sorted(store.committed().items()))
    if not markers:
        raise FileNotFoundError(f"{run.url}: no committed extract shards to train on")
    cached = (run.read_json(INDEX_KEY) or {}) if use_cache else {}
    entries: dict[str, dict[str, Any]] = {}
    for shard_id, marker in markers.items():
        entry = cached.get(shard_id)
        part_shas = [p["sha256"] for p in marker_parts(marker)]
        if entry is None or entry.get("part_sha256") != part_shas:
            entry = {"part_sha256": part_shas, "parts": []}
            for data in store.iter_parts(marker):
                lengths, splits, ids = [], [], []
                for seq in iter_shard_tokens(data):
                    lengths.append(int(seq.input_ids.numel()))
                    splits.append(seq.split)
                    ids.append(seq.sequence_id)
                    if visit is not None:
                        visit(seq)
                entry["parts"].append({"lengths": lengths, "splits": splits, "ids": ids})
        entries[shard_id] = entry
    if entries != cached:
        run.write_json_atomic(INDEX_KEY, entries)
    refs = [
        SeqRef(shard_id, part, i, length, split, seq_id)
        for shard_id, entry in entries.items()
        for part, listing in enumerate(entry["parts"])
        for i, (length, split, seq_id) in enumerate(
            zip(listing["lengths"], listing["splits"], listing.get("ids") or [""] * len(listing["lengths"]),
                strict=True)
        )
    ]
    return DataIndex(markers, refs)


def write_data_metadata(run: RunFolder, mode: str, meta: dict[str, Any], index: DataIndex) -> None:
    """Record the training data: the mode, the states' layout, the index's split counts and
    the held-out split's identity, which the gate's replay of an online run checks."""
    splits = {name: len(index.split(name)) for name in ("train", "eval")}
    run.write_json_atomic(DATA_META_KEY, {
        "hidden_states": mode, "hidden_size": int(meta["hidden_size"]),
        "aux_layer_ids": [int(i) for i in meta["aux_layer_ids"]],
        "storage_dtype": meta.get("storage_dtype"), "splits": splits,
        "holdout": meta.get("holdout"),  # the held-out split's holdout_digest (None: made before the key)
    })  # fmt: skip


def training_data_metadata(run: RunFolder) -> dict[str, Any]:
    """hidden_size, aux_layer_ids and split counts of the states the draft trained on: what
    the trainer recorded, else (a run trained before it did) the extract shards'."""
    recorded = run.read_json(DATA_META_KEY)
    if recorded is not None:
        return recorded
    from tasks.extract.storage import extract_metadata

    return {"hidden_states": "offline", **extract_metadata(run)}


def _pack(refs: list[SeqRef], batch_tokens: int) -> list[list[SeqRef]]:
    """Greedy over length-sorted refs: a batch grows while rows x longest <= batch_tokens."""
    batches: list[list[SeqRef]] = []
    current: list[SeqRef] = []
    for ref in sorted(refs, key=lambda r: r.length):
        if current and (len(current) + 1) * ref.length > batch_tokens:
            batches.append(current)
            current = []
        current.append(ref)
    if current:
        batches.append(current)
    return batches


def plan_epoch(
    index: DataIndex, split: str, epoch: int, seed: int, batch_tokens: int, shuffle: bool = True
) -> list[list[SeqRef]]:
    """Every batch of one epoch, in order (the same list on every rank)."""
    rng = random.Random(f"eaglescale-train:{seed}:{epoch}")
    by_part: dict[tuple[str, int], list[SeqRef]] = {}
    for ref in index.split(split):
        by_part.setdefault((ref.shard_id, ref.part), []).append(ref)
    units = sorted(by_part)
    if shuffle:
        rng.shuffle(units)
    plan: list[list[SeqRef]] = []
    for unit in units:
        refs = by_part[unit]
        if shuffle:
            rng.shuffle(refs)
        batches = _pack(refs, batch_tokens)
        if shuffle:
            rng.shuffle(batches)
        plan.extend(batches)
    return plan


def rank_batches(plan: list[list[SeqRef]], rank: int, world: int, even: bool = True) -> list[list[SeqRef]]:
    """This rank's batches; `even` drops the tail so every rank steps the same number of times."""
    mine = plan[rank::world]
    return mine[: len(plan) // world] if even else mine


class SequenceReader(Protocol):
    """Where a batch's sequences (ids, mask and states, as ExtractedSequence) come from: the
    extract shards (ShardReader) or the target run on the spot (tasks.draft.online)."""

    def batch(self, refs: list[SeqRef]) -> list[Any]: ...


class ShardReader:
    """Decoded shard parts, one kept in memory at a time (plans visit parts contiguously)."""

    def __init__(self, run: RunFolder, index: DataIndex) -> None:
        self.store = ShardStore(run, STAGE)
        self.index = index
        self._unit: tuple[str, int] | None = None
        self._seqs: list[Any] = []

    def get(self, ref: SeqRef) -> Any:
        if (ref.shard_id, ref.part) != self._unit:
            from tasks.extract.storage import decode_extract_shard

            self._seqs = []  # release the previous part before decoding the next
            self._seqs = decode_extract_shard(
                self.store.read_part(self.index.markers[ref.shard_id], ref.part)
            )
            self._unit = (ref.shard_id, ref.part)
        return self._seqs[ref.index]

    def batch(self, refs: list[SeqRef]) -> list[Any]:
        return [self.get(r) for r in refs]


def collate(seqs: list[Any]) -> Batch:
    """Right-pad ExtractedSequences into a Batch (ids 0, mask False, zero states). The states
    are padded where they lie, in their dtype (an online reader's may be on the GPU already);
    ids, mask and lengths are always on the host."""
    lengths = torch.tensor([s.input_ids.numel() for s in seqs], dtype=torch.int64)
    b, t = len(seqs), int(lengths.max())
    aux0, last0 = seqs[0].aux_hidden, seqs[0].last_hidden
    ids = torch.zeros(b, t, dtype=torch.int64)
    mask = torch.zeros(b, t, dtype=torch.bool)
    aux = torch.zeros(b, t, aux0.shape[1], dtype=aux0.dtype, device=aux0.device)
    last = torch.zeros(b, t, last0.shape[1], dtype=last0.dtype, device=last0.device)
    for i, s in enumerate(seqs):
        n = s.input_ids.numel()
        ids[i, :n] = s.input_ids
        mask[i, :n] = s.loss_mask
        aux[i, :n] = s.aux_hidden
        last[i, :n] = s.last_hidden
    return Batch(ids, mask, aux, last, lengths)


def iter_batches(
    reader: SequenceReader,
    batches: list[list[SeqRef]],
    start: int = 0,
    pin: bool = False,
    prefetch: int = 2,
) -> Iterator[Batch]:
    """Collated batches from `start` on, made `prefetch` ahead by a worker thread (reading,
    decoding and padding overlap the GPU's step); `pin` puts them in page-locked memory."""
    todo = batches[start:]
    if prefetch <= 0:
        for refs in todo:
            yield collate(reader.batch(refs))
        return
    ready: queue.Queue = queue.Queue(maxsize=prefetch)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for refs in todo:
                batch = collate(reader.batch(refs))
                if not put(batch.pinned() if pin else batch):
                    return
            put(_END)
        except BaseException as e:  # handed to the consumer, raised there
            put(e)

    worker = threading.Thread(target=work, name="draft-batches", daemon=True)
    worker.start()
    try:
        while True:
            item = ready.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        worker.join()


_END = object()
