"""Deterministic shards of the manifest: contiguous prompt_id ranges of the sorted manifest.

The plan is written once to prompts/shards.json and reused on every resume, so a changed
shard size in the params never re-cuts shards that already hold committed work.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import asdict, dataclass

from tasks.runfolder import FingerprintMismatch, RunFolder, content_hash, request_id
from tasks.runfolder.layout import SHARD_PLAN

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardPlan:
    shard_id: str
    first_prompt_id: str
    last_prompt_id: str
    n_prompts: int


@dataclass(frozen=True)
class PlannedRequest:
    request_id: str
    prompt_id: str
    sample_index: int


def cut_shards(sorted_prompt_ids: list[str], shard_size: int) -> list[ShardPlan]:
    shards = []
    for index, start in enumerate(range(0, len(sorted_prompt_ids), shard_size)):
        ids = sorted_prompt_ids[start : start + shard_size]
        shard_id = f"s{index:05d}-{content_hash(ids, 8)}"
        shards.append(ShardPlan(shard_id, ids[0], ids[-1], len(ids)))
    return shards


def load_or_plan_shards(
    run: RunFolder, manifest_hash: str, sorted_prompt_ids: list[str], shard_size: int
) -> list[ShardPlan]:
    existing = run.read_json(SHARD_PLAN)
    if existing is not None:
        if existing["manifest_hash"] != manifest_hash:
            raise FingerprintMismatch(
                f"{run.url}/{SHARD_PLAN} was planned for manifest {existing['manifest_hash']}, "
                f"but the manifest is now {manifest_hash}"
            )
        if existing["shard_size"] != shard_size:
            log.warning(
                "keeping the run's shard size %d (params ask for %d): shards hold committed work",
                existing["shard_size"],
                shard_size,
            )
        return [ShardPlan(**s) for s in existing["shards"]]
    shards = cut_shards(sorted_prompt_ids, shard_size)
    run.write_json_atomic(
        SHARD_PLAN,
        {
            "manifest_hash": manifest_hash,
            "shard_size": shard_size,
            "shards": [asdict(s) for s in shards],
        },
    )
    return shards


def shard_prompt_ids(shard: ShardPlan, sorted_prompt_ids: list[str]) -> list[str]:
    lo = bisect.bisect_left(sorted_prompt_ids, shard.first_prompt_id)
    hi = bisect.bisect_right(sorted_prompt_ids, shard.last_prompt_id)
    return sorted_prompt_ids[lo:hi]


def planned_requests(
    prompt_ids: list[str], fp_hash: str, samples_per_prompt: int
) -> list[PlannedRequest]:
    return [
        PlannedRequest(request_id(fp_hash, pid, k), pid, k)
        for pid in prompt_ids
        for k in range(samples_per_prompt)
    ]
