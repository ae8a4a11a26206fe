"""The slots of a synthesized source, and the shards that hold them.

Slot i of source S is one request: its id (the "prompt id" of generation's rows) is `S#i`, its
request id is `request_id(H, S#i, 0)`, where H hashes the target's identity and every setting
that changes what the target writes (SYNTHESIS_SETTINGS), and its sampling seed is derived from
the request id (`GenerationRequest.seed()`) and the source's seed. So a resumed run, any worker,
sends the same request for a slot and writes the same prompt, while a changed setting or target
makes new request ids: nothing journaled under the old ones is taken for the new.

Shards are ranges of slots, `S-H[:8]-start-end`, of `generate.shard_size` slots: the size is
recorded per source and hash in synthesize/plan.json the first time, so a resume with another
shard_size does not re-cut shards that hold committed work. A grown `count` adds shards (the
last, partial one becomes another shard); the ones before are kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tasks.config import SourceConfig
from tasks.engines.base import SamplingParams
from tasks.generate.plan import PlannedRequest
from tasks.runfolder import RunFolder, content_hash, request_id
from tasks.runfolder.layout import SYNTHESIS_PLAN, SYNTHESIS_STAGE

STAGE = SYNTHESIS_STAGE
PLAN_KEY = SYNTHESIS_PLAN
# What the target writes for a slot depends on these (and on the target): each is in the hash.
SYNTHESIS_SETTINGS = ("system_prompt", "seed_text", "max_request_tokens", "temperature", "top_p", "top_k", "seed")
_VERSION = 1  # of the request format; a change that writes other prompts bumps it


@dataclass(frozen=True)
class SlotShard:
    shard_id: str
    source: str
    start: int  # first slot
    end: int  # one past the last slot

    def planned(self, synthesis_hash: str) -> list[PlannedRequest]:
        return [PlannedRequest(request_id(synthesis_hash, slot_id(self.source, i), 0), slot_id(self.source, i), 0)
                for i in range(self.start, self.end)]  # fmt: skip


def slot_id(source: str, index: int) -> str:
    return f"{source}#{index:08d}"


def slot_index(slot: str) -> int:
    return int(slot.rsplit("#", 1)[1])


def synthesis_hash(src: SourceConfig, target_identity: dict[str, Any]) -> str:
    settings = {k: getattr(src, k) for k in SYNTHESIS_SETTINGS}
    return content_hash({"target": target_identity, "synthesis": settings, "version": _VERSION}, 16)


def synthesis_sampling(src: SourceConfig) -> SamplingParams:
    return SamplingParams(src.temperature, src.top_p, src.top_k, src.max_request_tokens, src.seed)


def cut_slots(source: str, hash_: str, count: int, shard_size: int) -> list[SlotShard]:
    return [SlotShard(f"{source}-{hash_[:8]}-{start:08d}-{min(start + shard_size, count):08d}", source, start,
                      min(start + shard_size, count))
            for start in range(0, count, shard_size)]  # fmt: skip


def plan_slots(run: RunFolder, sources: dict[str, tuple[SourceConfig, str]], shard_size: int) -> list[SlotShard]:
    """Every synthesized source's shards (`sources`: name -> (config, synthesis hash)), with the
    shard size each (name, hash) was first planned with."""
    recorded: dict[str, Any] = run.read_json(PLAN_KEY) or {}
    plan = dict(recorded)
    shards: list[SlotShard] = []
    for name, (src, hash_) in sources.items():
        entry = recorded.get(name)
        size = entry["shard_size"] if entry and entry["hash"] == hash_ else shard_size
        plan[name] = {"hash": hash_, "shard_size": size, "count": src.count}
        shards += cut_slots(name, hash_, int(src.count or 0), size)
    if plan != recorded:
        run.write_json_atomic(PLAN_KEY, plan)
    return shards
