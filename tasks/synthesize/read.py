"""What the synthesis committed, read back as discovery's input: one SynthesizedRequest a slot.

Every shard of the plan must be committed; each is read through its marker (sha256-verified), its
rows and its dead letters, so every slot is exactly one of them. Template tokens inside a request
(besides the stop token that ends it) are counted from its ids here, where the tokenizer is: the
request's text was decoded without them and could not show them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tasks.discover.synthesized import SynthesizedRequest, SynthesizedSet
from tasks.runfolder import ShardStore
from tasks.synthesize.plan import SlotShard, slot_index


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The template's tokens: the tokenizer's special ids and its added tokens marked special."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return frozenset({int(i) for i, tok in added.items() if getattr(tok, "special", False)}
                     | {int(i) for i in tokenizer.all_special_ids})  # fmt: skip


def _inside(output_ids: Sequence[int], finish_reason: str | None, special: frozenset[int]) -> int:
    ids = list(output_ids)
    if finish_reason == "stop" and ids:
        ids = ids[:-1]  # the stop token that ended the turn, where it belongs
    return sum(i in special for i in ids)


def read_synthesized(store: ShardStore, shards: Sequence[SlotShard], hashes: Mapping[str, str],
                     special: frozenset[int], summary: dict[str, Any]) -> SynthesizedSet:  # fmt: skip
    """Each source's slots from its committed shards (every shard must have its marker)."""
    committed = store.committed()
    requests: dict[str, list[SynthesizedRequest]] = {name: [] for name in hashes}
    for shard in shards:
        marker = committed.get(shard.shard_id)
        if marker is None:
            raise FileNotFoundError(f"{store.run.url}/{store.marker_key(shard.shard_id)}: the synthesis shard is not "
                                    "committed; run discovery again to finish the synthesis")  # fmt: skip
        out = requests[shard.source]
        for row in store.read_rows(marker).to_pylist():
            out.append(SynthesizedRequest(slot_index(row["prompt_id"]), row["request_id"], row["text"] or "",
                                          row["finish_reason"], int(row["completion_tokens"] or 0),
                                          _inside(row["output_ids"] or [], row["finish_reason"], special)))  # fmt: skip
        for row in store.read_dead(marker).to_pylist():
            out.append(SynthesizedRequest(slot_index(row["prompt_id"]), row["request_id"],
                                          error=f"{row['error_class']}: {row['message']}"))  # fmt: skip
    for out in requests.values():
        out.sort(key=lambda r: r.index)
    return SynthesizedSet(requests, summary)
