"""The extract stage as plain code: prepare (cleanup, settings check, disk forecast), run one
shard, finish. Flows only compose these.

Extract shard ids are generation shard ids; one training sequence per committed generation
row, keyed by its request_id. A shard commits through the same protocol as generation
(verify keys = planned - dead, atomic write, then the marker), so a crash anywhere leaves
either the whole shard or nothing. The stage reads its input as "the generation shards
marked so far" (`pending_shards`), so it can run while generation is still committing;
extract/_COMPLETE is written once generation is complete and every shard is extracted.

A shard's states are written as parts of about `part_bytes` while it is extracted (each a
self-contained safetensors object, decoded back and verified before it is written), then
committed under one marker listing them: a shard of 100+ GB never sits in host memory,
is never hashed in one pass, and no object exceeds S3's single-PUT limit.

Several workers may extract one run root: like generation, each shard runs under its lease
(tasks/runfolder/leases.py), checked between capture chunks and verified right before the
commit; start-up cleanup spares the parts of shards leased elsewhere, and a worker that takes
over a dead worker's shard removes the parts that worker left.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from transformers import PreTrainedModel

from tasks.config import EagleScaleConfig
from tasks.extract.backends import build_capture_backend, target_layout
from tasks.extract.capture import CaptureBackend, aux_capture_layers
from tasks.extract.forecast import check_forecast, forecast_extract
from tasks.extract.sequences import SequenceBuilder, ShardSequences, holdout_changed
from tasks.extract.storage import STAGE, ExtractFormatError, ShardWriter, verify_shard
from tasks.runfolder import (
    FingerprintMismatch,
    Lease,
    LeaseTable,
    LeaseView,
    PartWriter,
    RunFolder,
    ShardCommit,
    ShardStore,
    content_hash,
    new_attempt_id,
)
from tasks.runfolder.fingerprint import diff_fingerprints
from tasks.runfolder.schedule import run_under_lease

log = logging.getLogger(__name__)

DEAD_SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("prompt_id", pa.string()),
        ("error_class", pa.string()),
        ("message", pa.string()),
    ]
)
# Sequences handed to the backend per call: enough for length bucketing across batches,
# few enough that their states (held until encoded) stay small on the device.
CAPTURE_CHUNK_BATCHES = 8


@dataclass
class ExtractShardOutcome:
    shard_id: str
    status: str  # "committed" | "skipped" | "lost_race" | "leased" | "lease_lost"
    rows: int
    dead: int
    tokens: int
    truncated: int
    marker: dict[str, Any]


class ExtractStage:
    """Everything one process needs to extract shards of one run root."""

    def __init__(
        self,
        cfg: EagleScaleConfig,
        run: RunFolder,
        tokenizer: Any,
        backend: CaptureBackend | None = None,
        model: PreTrainedModel | None = None,
        part_bytes: int | None = None,
    ) -> None:
        self.cfg, self.run = cfg, run
        # The argument (tests) overrides extract.part_bytes.
        self.part_bytes = part_bytes if part_bytes is not None else cfg.extract.part_bytes
        self.gen = ShardStore(run, "generate")
        self.store = ShardStore(run, STAGE)
        ex = cfg.extract
        self.leases = LeaseTable(run, STAGE, ex.lease_ttl_s, ex.lease_heartbeat_s)
        self._sources: dict[str, dict[str, Any]] = {}  # generation markers, as last observed
        self._damaged: dict[str, Any] = {}  # shard -> the attempt whose files prepare() found damaged
        recorded = run.read_json("run.json")
        if recorded is None:
            raise FileNotFoundError(f"{run.url}/run.json is missing: run the generate stage first")
        self.layout = target_layout(cfg.target.model_path, cfg.target.revision)
        self.aux_layer_ids = aux_capture_layers(self.layout.model_type, self.layout.num_layers)
        self.settings: dict[str, Any] = {
            "aux_layer_ids": self.aux_layer_ids,
            "hidden_size": self.layout.hidden_size,
            "storage_dtype": ex.storage_dtype,
            "max_length": ex.max_length,
            "eval_fraction": ex.eval_fraction,
            "seed": ex.seed,
        }
        self.settings_hash = content_hash(
            {"run": recorded["fingerprint_hash"], **self.settings}, 16
        )
        # Refuses a changed chat template here, before any model is loaded.
        self.builder = SequenceBuilder(
            run, tokenizer, ex.max_length, self.layout.vocab_size, ex.eval_fraction, ex.seed,
            ex.holdout_unit,
        )  # fmt: skip
        self._backend = backend
        self._model = model
        self.forecast: dict[str, Any] = {}

    @property
    def backend(self) -> CaptureBackend:
        # Built on first use: prepare() may refuse (forecast, settings) before a big load.
        if self._backend is None:
            self._backend = build_capture_backend(self.cfg, self.aux_layer_ids, self._model)
        return self._backend

    def _stale(self, marker: dict[str, Any], source: dict[str, Any]) -> bool:
        return (
            marker.get("source_sha256") != source["sha256"]
            or marker["fingerprint"] != self.settings_hash
            or self._damaged.get(marker["shard_id"]) == marker.get("attempt")
            or holdout_changed(marker.get("holdout"), self.builder, "") is not None  # allowed to change
        )

    def _check_settings(self) -> None:
        for shard_id, marker in sorted(self.store.committed().items()):
            recorded = {k: marker.get(k) for k in self.settings}
            diffs = diff_fingerprints(recorded, self.settings)
            if diffs and not self.cfg.allow_fingerprint_change:
                raise FingerprintMismatch(
                    f"{self.run.url}/{STAGE}: shard {shard_id} was extracted with different "
                    f"settings; refusing to mix them (use a new run root, or "
                    f"allow_fingerprint_change to re-extract). Differing fields:\n  "
                    + "\n  ".join(diffs)
                )
            # Not part of the settings' hash, which every extraction before the key would fail:
            # a shard of another held-out split would mix two splits in one run.
            changed = holdout_changed(marker.get("holdout"), self.builder, f"{self.run.url}/{STAGE}: shard {shard_id}")
            if changed and not self.cfg.allow_fingerprint_change:
                raise FingerprintMismatch(changed + " (or allow_fingerprint_change to re-extract)")

    def pending_shards(self) -> list[str]:
        """Generation shards committed so far whose extraction is missing or stale, in order."""
        extracted = self.store.committed()
        return [
            shard_id
            for shard_id, source in sorted(self.gen.committed().items())
            if shard_id not in extracted or self._stale(extracted[shard_id], source)
        ]

    def prepare(self) -> list[str]:
        """Clean up after crashes, refuse changed settings or a forecast that does not fit,
        and return the shards to run (some may be leased by other workers right now)."""
        self.store.cleanup(protected=self.leases.live_shards)
        committed = self.store.committed()
        # Sizes only: one LIST, where hashing would read every stored byte (terabytes at
        # production scale) on each resume; the trainer and the gate verify each part's sha256
        # as they read it, naming the fix. A part missing or of another size is re-extracted.
        damaged = self.store.damaged(committed)
        for shard_id, problem in sorted(damaged.items()):
            log.warning("extract shard %s is damaged (%s): extracting it again", shard_id, problem)
        self._damaged = {s: committed[s].get("attempt") for s in damaged}
        self._check_settings()
        self.check_forecast()
        return self.pending_shards()

    def check_forecast(self) -> None:
        """Forecast from the generation markers committed so far and refuse when it does not
        fit. Run again as markers appear (overlap): a forecast made before any was committed
        projects nothing."""
        ex = self.cfg.extract
        self.forecast = forecast_extract(
            self.run,
            self.layout.hidden_size,
            ex.storage_dtype,
            ex.max_length,
            ex.quota_bytes,
            extra_per_sequence=len(self.builder.terminator),
        )
        check_forecast(self.forecast)

    def observe(self) -> tuple[dict[str, dict[str, Any]], dict[str, LeaseView]]:
        """(committed extract markers, current leases), from the run folder."""
        self._sources = self.gen.committed()
        committed = self.store.committed()
        done = {s for s, m in committed.items() if self.marker_done(s, m)}
        return committed, self.leases.scan(s for s in self._sources if s not in done)

    def marker_done(self, shard_id: str, marker: dict[str, Any]) -> bool:
        """A marker finishes its shard unless it is stale (as of the last `observe`)."""
        source = self._sources.get(shard_id)
        return source is not None and not self._stale(marker, source)

    def claim(self, shard_id: str) -> bool:
        """Take the shard's lease for this process; False while another worker holds it."""
        return self.leases.claim(shard_id) is not None

    def release(self, shard_id: str) -> None:
        self.leases.release(shard_id)

    def run_shard(self, shard_id: str) -> ExtractShardOutcome:
        """Extract one shard under its lease: the one `claim` took (the caller releases it),
        else one claimed and released here. A shard leased by a live worker elsewhere, or
        taken over mid-run, ends as "leased" / "lease_lost" without committing."""
        return run_under_lease(
            self.leases,
            shard_id,
            lambda lease: self._run_leased(shard_id, lease),
            lambda status: ExtractShardOutcome(shard_id, status, 0, 0, 0, 0, {}),
        )

    def _run_leased(self, shard_id: str, lease: Lease) -> ExtractShardOutcome:
        source = self.gen.marker(shard_id)
        if source is None:
            raise ValueError(f"shard {shard_id}: no committed generation shard of that id")
        existing = self.store.marker(shard_id)
        if existing is not None and not self._stale(existing, source):
            return ExtractShardOutcome(
                shard_id,
                "skipped",
                existing["rows"],
                existing["dead"],
                existing.get("tokens", 0),
                existing.get("truncated", 0),
                existing,
            )
        if "took_over" in lease.record:
            # The dead holder's parts were spared by every cleanup while its lease was live;
            # only this lease may write the shard now, so they are strays.
            self.store.cleanup(protected=lambda: self.leases.live_shards() - {shard_id})
        rows = self.gen.read_rows(source)
        built = self.builder.build(rows)
        parts = self.store.part_writer(shard_id, new_attempt_id(), "safetensors")
        keys, writer = self._capture(shard_id, built, parts, lease)
        dead = pa.Table.from_pylist(built.dead, schema=DEAD_SCHEMA)
        shard = ShardCommit(
            shard_id,
            parts.attempt,
            self.settings_hash,
            rows.column("request_id").to_pylist(),
            dead,
            extra=self._marker_fields(source, built, parts, writer),
            replace=existing is not None,
        )
        result = self.store.commit_parts(parts, keys, shard)
        log.info(
            "extract shard %s: %d sequences in %d parts, %d dead, %d tokens (%d truncated)",
            shard_id,
            len(keys),
            len(parts.parts),
            dead.num_rows,
            built.stats["tokens"],
            built.stats["truncated"],
        )
        return ExtractShardOutcome(
            shard_id,
            "committed" if result.won else "lost_race",
            len(keys),
            dead.num_rows,
            built.stats["tokens"],
            built.stats["truncated"],
            result.marker,
        )

    def _capture(
        self, shard_id: str, built: ShardSequences, parts: PartWriter, lease: Lease
    ) -> tuple[list[str], ShardWriter]:
        """Capture the built sequences' states chunk by chunk into parts, each decoded back
        before it is written; returns the keys decoded from every part, in order, and the
        writer (its reconstruction error goes in the marker). The lease is checked after each
        chunk and verified at the end; an attempt that will not commit removes its parts."""
        keys: list[str] = []

        def write_part(data: bytearray) -> None:
            part_keys = verify_shard(data)  # decoded back before it goes anywhere
            parts.write(data, len(part_keys))
            keys.extend(part_keys)

        writer = ShardWriter(
            self.layout.hidden_size,
            self.aux_layer_ids,
            self.cfg.extract.storage_dtype,
            part_bytes=self.part_bytes,
            on_part=write_part,
        )
        chunk = self.cfg.extract.batch_size * CAPTURE_CHUNK_BATCHES
        try:
            for start in range(0, len(built.sequences), chunk):
                group = built.sequences[start : start + chunk]
                writer.add_many(group, self.backend.capture([s.input_ids for s in group]))
                lease.check()
            writer.flush()
            if keys != [s.sequence_id for s in built.sequences]:
                raise ExtractFormatError(
                    f"shard {shard_id}: sequence ids decoded from its {len(parts.parts)} parts "
                    "differ from the built ones"
                )
            lease.verify()  # asks the store: a takeover seen here stops before the marker
        except BaseException:
            parts.abort()  # an attempt that will not commit leaves no parts behind
            raise
        return keys, writer

    def _marker_fields(
        self, source: dict[str, Any], built: ShardSequences, parts: PartWriter, writer: ShardWriter
    ) -> dict[str, Any]:
        """Extraction's own fields of the shard's marker: its settings, the generation shard
        it read, and what it holds."""
        return {
            **self.settings,
            "holdout_unit": self.builder.holdout_unit,
            "holdout": self.builder.holdout,
            "source_sha256": source["sha256"],
            "source_attempt": source["attempt"],
            "bytes": parts.bytes,
            "tokens": built.stats["tokens"],
            "loss_tokens": built.stats["loss_tokens"],
            "truncated": built.stats["truncated"],
            "splits": built.stats["splits"],
            "dead_classes": built.stats["dead_classes"],
            "reconstruction_error": writer.error_report(),
        }

    def summary(self) -> dict[str, Any]:
        """Key numbers over every committed extract shard (not just this process's)."""
        markers = self.store.committed()
        splits = {"train": 0, "eval": 0}
        worst = {"aux": 0.0, "last": 0.0}
        for m in markers.values():
            for name, count in m.get("splits", {}).items():
                splits[name] = splits.get(name, 0) + count
            for name in worst:
                err = m.get("reconstruction_error", {}).get(name, {})
                worst[name] = max(worst[name], err.get("rel_rms", 0.0))
        return {
            "shards_generated": len(self.gen.committed()),
            "shards_extracted": len(markers),
            "shards_pending": len(self.pending_shards()),
            "sequences": sum(m["rows"] for m in markers.values()),
            "dead": sum(m["dead"] for m in markers.values()),
            "tokens": sum(m.get("tokens", 0) for m in markers.values()),
            "loss_tokens": sum(m.get("loss_tokens", 0) for m in markers.values()),
            "truncated": sum(m.get("truncated", 0) for m in markers.values()),
            "bytes": sum(m.get("bytes", 0) for m in markers.values()),
            "splits": splits,
            "storage_dtype": self.cfg.extract.storage_dtype,
            "max_rel_rms_error": worst,
        }

    def finish(self) -> dict[str, Any]:
        """Summary; extract/_COMPLETE once generation is complete and nothing is pending. The
        marker lists every extracted shard with the generation table it read (its sha256),
        however the shards were found: in one pass, or as they appeared (overlap)."""
        # Read before the summary's listing: that listing is then of generation's final shards.
        generation_complete = self.gen.is_complete()
        summary = self.summary()
        complete = generation_complete and summary["shards_pending"] == 0
        if complete:
            read = {s: m["source_sha256"] for s, m in sorted(self.store.committed().items())}
            self.store.mark_complete({**summary, "shards": read})
        return {**summary, "complete": complete}

    def close(self) -> None:
        """Release this process's leases and the capture backend (idempotent)."""
        self.leases.close()
        if self._backend is not None:
            self._backend.close()
            self._backend = None

