"""The generate stage as plain code: plan shards, run one, summarize. Flows only compose these."""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tasks.config import EagleScaleConfig
from tasks.discover.commit import discovery_marker, read_prompts_table
from tasks.engines.base import Engine, GenerationResult, Outcome, SamplingParams
from tasks.engines.factory import get_engine
from tasks.engines.served import TargetNeeds
from tasks.generate.failures import GenerateFailed, ShardStopped, generate_failed
from tasks.generate.plan import ShardPlan, load_or_plan_shards, planned_requests, shard_prompt_ids
from tasks.generate.progress import ProgressTracker, ShardDone, first_started_at
from tasks.generate.reuse import EarlierRun, open_earlier_run
from tasks.generate.rows import is_reused
from tasks.generate.shard import (
    STAGE,
    Sender,
    ShardHooks,
    ShardJob,
    ShardOutcome,
    ShardRules,
    run_shard,
)
from tasks.redaction import redact_url
from tasks.runfolder import Lease, LeaseLost, LeaseTable, LeaseView, RunFolder, ShardStore
from tasks.runfolder.layout import GENERATE_PROGRESS
from tasks.runfolder.schedule import run_under_lease
from tasks.target.tokenizer import render_prompt_ids

log = logging.getLogger(__name__)


def current_fingerprint(cfg: EagleScaleConfig, run: RunFolder, tokenizer: Any) -> dict[str, Any]:
    """The run's fingerprint for generation as this configuration gives it: the committed
    discovery marker (its manifest hash), the target's identity and the config."""
    from tasks.fingerprint_fields import run_fingerprint
    from tasks.target.identity import target_identity

    marker = discovery_marker(run)
    if marker is None:
        raise RuntimeError(f"{run.url}: no committed prompts/; run the discover stage first")
    identity = target_identity(cfg.target.model_path, cfg.target.revision, tokenizer)
    return run_fingerprint(cfg, identity, marker["manifest_hash"])


def generation_fingerprint(cfg: EagleScaleConfig, run: RunFolder, tokenizer: Any) -> str:
    """The run's fingerprint hash for generation, found as extraction finds its own
    (`current_fingerprint`), recorded in run.json on a fresh run and checked against it on a
    resumed one (a mismatch raises naming the differing fields, unless allow_fingerprint_change)."""
    from tasks.runfolder import ensure_fingerprint

    fingerprint = current_fingerprint(cfg, run, tokenizer)
    return ensure_fingerprint(run, fingerprint, cfg.allow_fingerprint_change)


def target_needs(cfg: EagleScaleConfig, prompt_tokens: tuple[int, ...], max_new_tokens: int) -> TargetNeeds:
    """What a generation server must serve for these prompts (sorted lengths) and reply cap."""
    from tasks.target.model_dir import read_model_config, resolve_model_dir, text_config

    t = cfg.target
    model_config = text_config(read_model_config(resolve_model_dir(t.model_path, t.revision)))
    return TargetNeeds(
        model_path=t.model_path,
        vocab_size=int(model_config["vocab_size"]),
        max_new_tokens=max_new_tokens,
        prompt_tokens=prompt_tokens,
        max_dead_fraction=cfg.generate.max_dead_fraction,
    )


def sampling_params(cfg: EagleScaleConfig, domain: str | None = None) -> SamplingParams:
    """The requests' sampling; with `domain`, its own reply cap (sampling.max_new_tokens_by_domain)."""
    s = cfg.sampling
    cap = s.max_new_tokens if domain is None else s.max_new_tokens_for(domain)
    return SamplingParams(s.temperature, s.top_p, s.top_k, cap, s.seed)


@dataclass
class GenerateStage:
    """Everything one process needs to run generation shards of one run root."""

    cfg: EagleScaleConfig
    run: RunFolder
    fp_hash: str
    engine: Engine
    tokenizer: Any
    shards: list[ShardPlan] = field(init=False)
    progress: ProgressTracker = field(init=False)

    def __post_init__(self) -> None:
        self.store = ShardStore(self.run, STAGE)
        g = self.cfg.generate
        self.leases = LeaseTable(self.run, STAGE, g.lease_ttl_s, g.lease_heartbeat_s)
        manifest = read_prompts_table(self.run, "manifest")
        self._messages = dict(
            zip(
                manifest.column("prompt_id").to_pylist(),
                manifest.column("messages").to_pylist(),
                strict=True,
            )
        )
        self._sorted_ids = sorted(self._messages)
        self._domains = dict(
            zip(manifest.column("prompt_id").to_pylist(), manifest.column("domain").to_pylist(), strict=True)
        )
        # Each prompt's length as the servers' check reads it against the largest reply cap: a
        # domain with a smaller cap (sampling.max_new_tokens_by_domain) needs that much less room.
        top = self.cfg.sampling.max_new_tokens_for()
        self._prompt_tokens = tuple(sorted(
            n + self.cfg.sampling.max_new_tokens_for(d) - top
            for n, d in zip(manifest.column("n_tokens").to_pylist(), manifest.column("domain").to_pylist(), strict=True)
        ))  # fmt: skip
        marker = discovery_marker(self.run) or {}
        self.shards = load_or_plan_shards(
            self.run, marker["manifest_hash"], self._sorted_ids, self.cfg.generate.shard_size
        )
        self._by_id = {s.shard_id: s for s in self.shards}
        self._sampling = sampling_params(self.cfg)
        # One SamplingParams per domain, built once: every request of a domain shares it.
        self._by_domain = {d: sampling_params(self.cfg, d) for d in set(self._domains.values())}
        self._render_lock = threading.Lock()
        self.stopping = False
        self._prepared_attempts: dict[str, str | None] = {}
        self._damaged: dict[str, str] = {}  # shard -> what prepare() found wrong with its files
        self._earlier: EarlierRun | None = None  # generate.reuse_from, checked by prepare()
        reuse_from = self.cfg.generate.reuse_from
        k = self.cfg.sampling.samples_per_prompt
        try:
            previous = self.run.read_json(GENERATE_PROGRESS)
        except ValueError:  # a torn file: this process's own start will do
            previous = None
        self.progress = ProgressTracker(
            self.run,
            {s.shard_id: {"requests": s.n_prompts * k} for s in self.shards},
            max_new_tokens=self.cfg.sampling.max_new_tokens_for(),
            stall_after_s=self.cfg.generate.stall_after_s,
            interval_s=self.cfg.generate.progress_interval_s,
            first_started_at=first_started_at(previous),
            reused_from=None if reuse_from is None else redact_url(reuse_from),
        )

    def prepare(self) -> list[str]:
        """Clean up after crashes and return the shards still to run, in plan order (some
        may be leased by other workers right now: `claimable` says which to start).

        With generate.reuse_from, the earlier run is checked first: one this run cannot reuse
        is refused here, before any request is sent and before anything is written."""
        reuse_from = self.cfg.generate.reuse_from
        if reuse_from is not None:
            fingerprint = current_fingerprint(self.cfg, self.run, self.tokenizer)
            self._earlier = open_earlier_run(reuse_from, self.cfg.storage_options, fingerprint)
        self.store.cleanup(protected=self.leases.live_shards)
        committed = self.store.committed()
        self._prepared_attempts = {s: m.get("attempt") for s, m in committed.items()}
        # What a resume skips is checked first, whole: generation's shards hold text and ids
        # only (about 1 GB for the kimi-k25 profile's 83k rows, seconds to read and hash even
        # from S3, against a 40-hour run), and a flipped byte would otherwise pass as done
        # and fail extraction and training hours later. A damaged shard is rebuilt from its
        # journal (run_shard with rebuild).
        self._damaged = self.store.damaged(committed, hash_data=True)
        for shard_id, problem in sorted(self._damaged.items()):
            log.warning("shard %s is damaged (%s): rebuilding it from its journal", shard_id, problem)
        retry_dead = self.cfg.generate.retry_dead
        pending = []
        for shard in self.shards:
            marker = committed.get(shard.shard_id)
            if marker is None or shard.shard_id in self._damaged or (retry_dead and marker["dead"] > 0):
                pending.append(shard.shard_id)
                self.progress.shard_state(shard.shard_id, "pending")
            else:
                self.progress.mark_committed(shard.shard_id, ShardDone.from_marker(marker))
        self.progress.write()
        return pending

    def check_servers(self) -> list[str]:
        """Before any shard: every generation server that answers must serve the target (else
        WrongModel, naming it and what differs), and one must answer (else ServersUnreachable);
        from then on every answer's ids must lie in the target's vocabulary. Returns notes."""
        needs = target_needs(self.cfg, self._prompt_tokens, self.cfg.sampling.max_new_tokens_for())
        return self.engine.check_servers(needs)

    def _sampling_of(self, prompt_id: str) -> SamplingParams:
        return self._by_domain[self._domains[prompt_id]]

    def _detokenize(self, output_ids: list[int]) -> str:
        # What SGLang's detokenizer returns by default (skip_special_tokens): the reply's text.
        return self.tokenizer.decode(output_ids, skip_special_tokens=True)

    def _render(self, prompt_ids: list[str]) -> list[list[int]]:
        # Tokenizers are not guaranteed thread-safe; shard tasks share this one. One critical
        # section per shard, not per prompt: shards starting together would otherwise
        # interleave and none would send a request until all had rendered (P7).
        with self._render_lock:
            return [render_prompt_ids(self.tokenizer, json.loads(self._messages[p])) for p in prompt_ids]

    def claim(self, shard_id: str) -> bool:
        """Take the shard's lease for this process; False while another worker holds it."""
        return self.leases.claim(shard_id) is not None

    def release(self, shard_id: str) -> None:
        self.leases.release(shard_id)

    def marker_done(self, shard_id: str, marker: dict[str, Any]) -> bool:
        """retry-dead and damaged shards are rerun though marked: only a newer marker than the
        one prepare() saw finishes such a shard."""
        if shard_id in self._damaged:
            return marker.get("attempt") != self._prepared_attempts.get(shard_id)
        if not self.cfg.generate.retry_dead or marker.get("dead", 0) == 0:
            return True
        return marker.get("attempt") != self._prepared_attempts.get(shard_id)

    def lease_views(self) -> dict[str, LeaseView]:
        return self.leases.scan()

    def run_shard(self, shard_id: str) -> ShardOutcome:
        """Run one shard under its lease: the one `claim` took (kept afterwards, the caller
        releases it), else one claimed and released here. A shard leased by a live worker
        elsewhere, or taken over mid-run, ends as "leased" / "lease_lost", not as a failure."""
        return run_under_lease(
            self.leases,
            shard_id,
            lambda lease: self._run_leased(shard_id, lease),
            lambda status: self._not_ours(shard_id, status),
        )

    def _not_ours(self, shard_id: str, status: str) -> ShardOutcome:
        view = self.leases.scan([shard_id]).get(shard_id)
        detail = view.describe() if view else ""
        self.progress.shard_state(shard_id, "leased", lease=detail)
        return ShardOutcome(shard_id, status, 0, 0, 0, 0, 0, {})

    def _run_leased(self, shard_id: str, lease: Lease) -> ShardOutcome:
        shard = self._by_id[shard_id]
        ids = shard_prompt_ids(shard, self._sorted_ids)
        planned = planned_requests(ids, self.fp_hash, self.cfg.sampling.samples_per_prompt)
        self.progress.shard_state(shard_id, "running")

        def on_outcome(outcome: Outcome) -> None:
            if isinstance(outcome, GenerationResult):
                tokens = (outcome.prompt_tokens, outcome.completion_tokens)
                self.progress.record(shard_id, 1, *tokens, sent=outcome.attempts)
            else:
                self.progress.record(shard_id, 1, 0, 0, dead=1, sent=outcome.attempts)

        def on_replay(ok: dict[str, dict], dead: dict[str, dict], sent: int) -> None:
            done = ShardDone(
                len(ok) + len(dead),
                sum(r.get("prompt_tokens", 0) for r in ok.values()),
                sum(r.get("completion_tokens", 0) for r in ok.values()),
                dead=len(dead),
                sent=sent,
                reused=sum(is_reused(r) for r in ok.values()),
            )
            self.progress.mark_resumed(shard_id, done)

        g = self.cfg.generate
        try:
            # Under the shard's lease, so its journal has one writer; a marked shard (another
            # worker's commit, a damaged or retry-dead one) is left to run_shard as it is.
            if self._earlier is not None and self.store.marker(shard_id) is None:
                self._earlier.journal_reused(self.store, shard_id, planned, g.journal_flush_s)
            outcome = run_shard(
                ShardJob(self.store, shard_id, planned, self.fp_hash, self._damaged.get(shard_id), self._domains),
                Sender(self._render, self.engine, self._sampling, self._detokenize, self._sampling_of),
                ShardRules(g.max_dead_fraction, g.journal_flush_s, g.retry_dead),
                ShardHooks(on_outcome, on_replay),
                lease,
            )
        except LeaseLost:
            raise
        except Exception as e:
            if self.stopping:
                self.progress.shard_state(shard_id, "stopped")
                raise ShardStopped(f"shard {shard_id}: stopped; its results so far are journaled") from e
            self.progress.shard_state(shard_id, "failed", error=str(e)[:500])
            raise
        self.progress.shard_state(shard_id, "committed", rows=outcome.rows, dead=outcome.dead)
        return outcome

    def observe(self) -> tuple[dict[str, dict[str, Any]], dict[str, LeaseView]]:
        """(committed markers, current leases) of every shard, from the run folder; shards
        committed or leased by other workers are reflected in progress."""
        committed = self.store.committed()
        # Finished shards' leases no longer matter: read only the others' (one GET each).
        done = {s for s, m in committed.items() if self.marker_done(s, m)}
        views = self.leases.scan(s for s in self._by_id if s not in done)
        for shard_id, marker in committed.items():
            if shard_id in self._by_id:
                self.progress.note_committed_elsewhere(shard_id, ShardDone.from_marker(marker))
        for shard_id, view in views.items():
            if (
                shard_id in self._by_id
                and shard_id not in committed
                and not self.leases.held(shard_id)
            ):
                state = "leased" if view.live else "lease-expired"
                self.progress.shard_state(shard_id, state, lease=view.describe())
        return committed, views

    def tick(self) -> bool:
        """Called periodically by the flow: refresh server health and write progress if due."""
        self.progress.set_server_health(self.engine.health())
        return self.progress.maybe_write()

    def summary(self) -> dict[str, Any]:
        """Key numbers over every committed shard (not just this process's); a damaged shard
        not rebuilt is not committed."""
        committed = {
            s: m
            for s, m in self.store.committed().items()
            if s not in self._damaged or self.marker_done(s, m)
        }
        quality: Counter[str] = Counter()
        dead_classes: Counter[str] = Counter()
        for m in committed.values():
            quality.update(m.get("quality", {}))
            dead_classes.update(m.get("dead_classes", {}))
        rows = sum(m["rows"] for m in committed.values())
        done = rows + sum(m["dead"] for m in committed.values())
        sent = sum(m.get("requests_sent", m["rows"] + m["dead"]) for m in committed.values())
        reused = sum(m.get("reused", 0) for m in committed.values())
        generated = done - reused  # reused requests were never sent
        return {
            "shards_total": len(self.shards),
            "shards_committed": len(committed),
            "rows": rows,
            "dead": sum(m["dead"] for m in committed.values()),
            "prompt_tokens": sum(m.get("prompt_tokens", 0) for m in committed.values()),
            "completion_tokens": sum(m.get("completion_tokens", 0) for m in committed.values()),
            "finish_length_rate": quality["finish_length"] / rows if rows else 0.0,
            # per domain: rows, and how many stopped at the domain's reply cap (finish "length")
            "finish_length_by_domain": capped_by_domain(committed.values(), self.cfg),
            "empty_outputs": quality["empty_output"],
            "unterminated_think": quality["unterminated_think"],
            "dead_classes": dict(dead_classes),
            # requests sent to the engine, retries included; per request generated (not reused)
            # 1.0 = none sent twice
            "requests_sent": sent,
            "sent_per_request": round(sent / generated, 4) if generated else None,
            # rows copied from an earlier run (generate.reuse_from) instead of generated
            "reused": reused,
            "reused_from": self.progress.reused_from,
        }

    def failure(self, causes: dict[str, BaseException | str]) -> GenerateFailed:
        """The error for shards left uncommitted, with the fix per cause (current values quoted)."""
        c = self.cfg
        settings = {
            "sampling.max_new_tokens": c.sampling.max_new_tokens,
            "discover.max_prompt_tokens": c.discover.max_prompt_tokens,
            "generate.max_dead_fraction": c.generate.max_dead_fraction,
        }
        return generate_failed(causes, len(self.shards), c.generate.max_dead_fraction, settings)

    def stop(self) -> None:
        """The run is stopping: end the running shards now, not at their end. The engine drops
        its requests (in flight and queued); every shard journals the outcomes it has and ends
        with ShardStopped. Leases are released by `close`, once the shards have ended."""
        self.stopping = True
        self.engine.close()
        self.progress.set_state("stopped")
        self.progress.write()

    def close(self) -> None:
        """Stop heartbeating and release this process's leases (idempotent)."""
        self.leases.close()

    def finish(self) -> dict[str, Any]:
        self.close()
        summary = self.summary()
        complete = summary["shards_committed"] == summary["shards_total"]
        if complete:
            self.store.mark_complete(summary)
        self.progress.set_server_health(self.engine.health())
        self.progress.set_state("complete" if complete else "failed")
        self.progress.write()
        return summary


def capped_by_domain(markers: Iterable[dict[str, Any]], cfg: EagleScaleConfig) -> dict[str, dict[str, Any]]:
    """Per domain, over the markers that count per domain (those committed before they did are
    left out): rows, replies that hit the cap, their share, and the cap."""
    total: dict[str, Counter[str]] = {}
    for m in markers:
        for domain, counts in (m.get("by_domain") or {}).items():
            total.setdefault(domain, Counter()).update(counts)
    return {
        d: {"rows": c["rows"], "finish_length": c["finish_length"],
            "rate": round(c["finish_length"] / c["rows"], 4) if c["rows"] else 0.0,
            "max_new_tokens": cfg.sampling.max_new_tokens_for(d)}
        for d, c in sorted(total.items())
    }  # fmt: skip


def open_generate_stage(cfg: EagleScaleConfig, run: RunFolder, tokenizer: Any) -> GenerateStage:
    """The run's generate stage as every runner opens it (the flow, the H200 runner's plain entry
    points): the run's fingerprint recorded or checked, then the configured engine (one per
    process and configuration)."""
    fp_hash = generation_fingerprint(cfg, run, tokenizer)
    return GenerateStage(cfg, run, fp_hash, get_engine(cfg), tokenizer)
