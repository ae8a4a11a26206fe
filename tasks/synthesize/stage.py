"""The synthesis of the synthesized sources' prompts, and the discover stage that runs it first.

Each shard of slots (plan.py) runs through the generation stage's own shard protocol,
`tasks/generate/shard.py::run_shard`, under its lease in `synthesize/leases/`: every outcome is
journaled in `synthesize/journal/<shard>/` before it counts, the shard commits once, as rows of
generation's schema, to `synthesize/data/` with its marker in `synthesize/_SUCCESS/`, and a rerun
sends only the slots no journal holds. The engine is generation's (`engine.*`: the same SGLang
servers, or the in-process model), opened only when a shard is left to run; so is everything
about the shards (`generate.shard_size`, `max_parallel_shards`, `max_dead_fraction`, the lease
timing, the journal's flush).

The prompt every slot of a source is written from is the target's chat template up to the start
of a user turn (after the source's system prompt) and its seed text (tasks/target/pre_query.py),
found before anything else: a template without one is refused, naming the target.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from tasks.config import EagleScaleConfig, GenerateConfig, SourceConfig
from tasks.discover.stage import run_discover_stage
from tasks.discover.synthesized import SynthesizedSet
from tasks.engines.base import Engine, GenerationRequest, GenerationResult, Outcome, SamplingParams
from tasks.engines.factory import get_engine
from tasks.errors import ExpectedFailure
from tasks.generate.failures import cannot_heal
from tasks.generate.shard import STAGE as GENERATE_STAGE
from tasks.generate.shard import Sender, ShardHooks, ShardJob, ShardOutcome, ShardRules, run_shard
from tasks.generate.stage import target_needs
from tasks.runfolder import Lease, LeaseTable, LeaseView, RunFolder, ShardStore
from tasks.runfolder.schedule import ShardScheduler, drive_shards, run_under_lease
from tasks.synthesize.plan import STAGE, plan_slots, synthesis_hash, synthesis_sampling
from tasks.synthesize.read import read_synthesized, special_token_ids
from tasks.target.identity import target_identity
from tasks.target.pre_query import pre_query_ids

log = logging.getLogger(__name__)
if STAGE == GENERATE_STAGE:  # the journals and markers of the two must never mix
    raise ImportError("the synthesis' run-folder stage must not be generation's")


class SynthesisFailed(RuntimeError, ExpectedFailure):
    """Slots were left uncommitted: discovery cannot read every synthesized source's rows."""


@dataclass(frozen=True)
class SourcePlan:
    """One synthesized source as the synthesis runs it."""

    src: SourceConfig
    hash: str  # synthesis_hash: the request ids' namespace
    prompt_ids: list[int]  # what each of its slots is written from
    sampling: SamplingParams


class SynthesisStage:
    """The synthesized sources' shards of one run root, for one process (a LeasedStage)."""

    def __init__(self, cfg: EagleScaleConfig, run: RunFolder, tokenizer: Any,
                 engine: Callable[[], Engine] | None = None) -> None:  # fmt: skip
        self.cfg, self.run, self.tokenizer = cfg, run, tokenizer
        g = cfg.generate
        self.store = ShardStore(run, STAGE)
        self.leases = LeaseTable(run, STAGE, g.lease_ttl_s, g.lease_heartbeat_s)
        identity = target_identity(cfg.target.model_path, cfg.target.revision, tokenizer)
        self.sources = {
            src.name: SourcePlan(src, synthesis_hash(src, identity),
                                 pre_query_ids(tokenizer, src.system_prompt, src.seed_text, cfg.target.model_path),
                                 synthesis_sampling(src))
            for src in cfg.discover.synthesized()
        }  # fmt: skip
        self.shards = plan_slots(run, {n: (p.src, p.hash) for n, p in self.sources.items()}, g.shard_size)
        self._by_id = {s.shard_id: s for s in self.shards}
        self._open_engine = engine or (lambda: get_engine(cfg))
        self._engine: Engine | None = None
        self._damaged: dict[str, str] = {}
        self._prepared_attempts: dict[str, str | None] = {}
        self._lock = threading.Lock()
        self.written_tokens = 0  # completion tokens of the requests this process sent
        self.stopping = False

    @property
    def engine(self) -> Engine:
        with self._lock:
            if self._engine is None:
                self._engine = self._open_engine()
            return self._engine

    def prepare(self) -> list[str]:
        """Clean up after crashes; the shards still to run (damaged ones are rebuilt from their
        journals, as generation's are)."""
        self.store.cleanup(protected=self.leases.live_shards)
        committed = {s: m for s, m in self.store.committed().items() if s in self._by_id}
        self._prepared_attempts = {s: m.get("attempt") for s, m in committed.items()}
        self._damaged = self.store.damaged(committed, hash_data=True)
        for shard_id, problem in sorted(self._damaged.items()):
            log.warning("synthesis shard %s is damaged (%s): rebuilding it from its journal", shard_id, problem)
        return [s.shard_id for s in self.shards if s.shard_id not in committed or s.shard_id in self._damaged]

    def first_requests(self, n: int) -> list[GenerationRequest]:
        """The first `n` slots' requests as their shards send them (prompt, sampling, seed): what
        a plain batched request of the synthesis' own shape is made of (gpunode's reference)."""
        out: list[GenerationRequest] = []
        for shard in self.shards:
            plan = self.sources[shard.source]
            out += [GenerationRequest(p.request_id, p.prompt_id, p.sample_index, tuple(plan.prompt_ids), plan.sampling)
                    for p in shard.planned(plan.hash)[: n - len(out)]]  # fmt: skip
        return out

    def check_servers(self) -> list[str]:
        """Before any shard: the servers serve the target (generation's check)."""
        lengths = tuple(sorted(len(p.prompt_ids) for p in self.sources.values()))
        cap = max(p.src.max_request_tokens for p in self.sources.values())
        return self.engine.check_servers(target_needs(self.cfg, lengths, cap))

    # -- LeasedStage ----------------------------------------------------------------------

    def observe(self) -> tuple[dict[str, dict[str, Any]], dict[str, LeaseView]]:
        committed = {s: m for s, m in self.store.committed().items() if s in self._by_id}
        return committed, self.leases.scan(s for s in self._by_id if s not in committed)

    def marker_done(self, shard_id: str, marker: dict[str, Any]) -> bool:
        if shard_id in self._damaged:  # only the rebuild's marker finishes a damaged shard
            return marker.get("attempt") != self._prepared_attempts.get(shard_id)
        return True

    def claim(self, shard_id: str) -> bool:
        return self.leases.claim(shard_id) is not None

    def release(self, shard_id: str) -> None:
        self.leases.release(shard_id)

    # -- one shard ------------------------------------------------------------------------

    def run_shard(self, shard_id: str) -> dict[str, Any]:
        """One shard under its lease; its outcome's summary (status "leased" / "lease_lost"
        when another worker has it)."""
        outcome = run_under_lease(self.leases, shard_id, lambda lease: self._run_leased(shard_id, lease),
                                  lambda status: ShardOutcome(shard_id, status, 0, 0, 0, 0, 0, {}))  # fmt: skip
        return {k: v for k, v in asdict(outcome).items() if k != "marker"}

    def _run_leased(self, shard_id: str, lease: Lease) -> ShardOutcome:
        shard = self._by_id[shard_id]
        plan = self.sources[shard.source]
        planned = shard.planned(plan.hash)
        job = ShardJob(self.store, shard_id, planned, plan.hash, self._damaged.get(shard_id),
                       {p.prompt_id: plan.src.domain for p in planned})  # fmt: skip
        sender = Sender(lambda ids: [plan.prompt_ids] * len(ids), self.engine, plan.sampling, self._detokenize)
        g = self.cfg.generate
        outcome = run_shard(job, sender, ShardRules(g.max_dead_fraction, g.journal_flush_s),
                            ShardHooks(on_outcome=self._count), lease)  # fmt: skip
        log.info("synthesis shard %s: %s, %d rows, %d dead, %d sent now", shard_id, outcome.status, outcome.rows,
                 outcome.dead, outcome.new_requests)  # fmt: skip
        return outcome

    def _count(self, outcome: Outcome) -> None:
        if isinstance(outcome, GenerationResult):
            with self._lock:
                self.written_tokens += outcome.completion_tokens

    def _detokenize(self, output_ids: list[int]) -> str:
        return self.tokenizer.decode(output_ids, skip_special_tokens=True)

    # -- the end --------------------------------------------------------------------------

    def stop(self) -> None:
        """The run is stopping: the engine drops its requests; each shard journals what it has."""
        self.stopping = True
        if self._engine is not None:
            self._engine.close()

    def close(self) -> None:
        self.leases.close()

    def summary(self, seconds: float) -> dict[str, Any]:
        committed = {s: m for s, m in self.store.committed().items() if s in self._by_id}
        per_source: dict[str, dict[str, Any]] = {}
        for shard in self.shards:
            entry = per_source.setdefault(shard.source, {"hash": self.sources[shard.source].hash, "slots": 0,
                                                         "rows": 0, "dead": 0, "finish_length": 0})  # fmt: skip
            entry["slots"] += shard.end - shard.start
            m = committed.get(shard.shard_id)
            if m is not None:
                entry["rows"] += m["rows"]
                entry["dead"] += m["dead"]
                entry["finish_length"] += m.get("quality", {}).get("finish_length", 0)
        rate = self.written_tokens / seconds if seconds > 0 and self.written_tokens else None
        return {
            "shards_total": len(self.shards),
            "shards_committed": len(committed),
            "requests": sum(e["slots"] for e in per_source.values()),
            "completion_tokens": sum(m.get("completion_tokens", 0) for m in committed.values()),
            "written_this_run": self.written_tokens,
            "seconds_this_run": round(seconds, 3),
            "tokens_per_s": None if rate is None else round(rate, 1),
            "engine": self.cfg.engine.kind,
            "sources": per_source,
        }


def _result_of(future: Future[dict[str, Any]]) -> dict[str, Any] | BaseException:
    if future.cancelled():
        return RuntimeError("the shard was cancelled before it started")
    return future.exception() or future.result()


def _drive(stage: SynthesisStage, pending: list[str], g: GenerateConfig) -> dict[str, BaseException | str]:
    """Every pending shard, up to `max_parallel_shards` at once in this process, each under its
    lease; shards leased by live workers elsewhere are waited on, expired ones taken over."""
    scheduler = ShardScheduler(stage, pending, g.max_parallel_shards)
    futures: list[Future[dict[str, Any]]] = []
    with ThreadPoolExecutor(g.max_parallel_shards, thread_name_prefix="synthesize") as pool:

        def start(shard_id: str, report: Callable[[Any], None]) -> None:
            future = pool.submit(stage.run_shard, shard_id)
            futures.append(future)
            future.add_done_callback(lambda f: report(_result_of(f)))

        try:
            return drive_shards(scheduler, start, min(5.0, g.lease_heartbeat_s),
                                lambda waiting: log.info("synthesis: waiting on shards leased elsewhere: %s", waiting),
                                fatal=cannot_heal)  # fmt: skip
        except BaseException:
            stage.stop()  # a signal: the running shards journal what they have and end now
            for future in futures:
                future.cancel()
            raise


def run_synthesis(cfg: EagleScaleConfig, run: RunFolder, tokenizer: Any,
                  engine: Callable[[], Engine] | None = None) -> SynthesizedSet:  # fmt: skip
    """Write every synthesized source's slots not yet committed, then read them all back."""
    stage = SynthesisStage(cfg, run, tokenizer, engine)
    began = time.perf_counter()
    try:
        pending = stage.prepare()
        if pending:  # before any shard: the servers serve the target, or nothing is sent
            for note in stage.check_servers():
                log.info("synthesis: %s", note)
        log.info("synthesis: %d shards planned, %d to run", len(stage.shards), len(pending))
        failures = _drive(stage, pending, cfg.generate) if pending else {}
        summary = stage.summary(time.perf_counter() - began)
    finally:
        stage.close()
    if summary["shards_committed"] < summary["shards_total"]:
        causes = "; ".join(f"{s}: {e}" for s, e in sorted(failures.items())) or "ended without a marker"
        raise SynthesisFailed(f"synthesis: {summary['shards_total'] - summary['shards_committed']} of "
                              f"{summary['shards_total']} shard(s) not committed ({causes})"[:2000])  # fmt: skip
    stage.store.mark_complete(summary)
    return read_synthesized(stage.store, stage.shards, {n: p.hash for n, p in stage.sources.items()},
                            special_token_ids(tokenizer), summary)  # fmt: skip


def discover_with_synthesis(cfg: EagleScaleConfig, run: RunFolder, tokenizer: Any,
                            engine: Callable[[], Engine] | None = None) -> dict[str, Any]:  # fmt: skip
    """The discover stage, its synthesized sources written first (not when discovery is already
    committed for this config: the stage skips, and so does the synthesis)."""
    return run_discover_stage(cfg, run, tokenizer, synthesize=lambda: run_synthesis(cfg, run, tokenizer, engine))
