"""discover_prompts: configured sources -> manifest, holdout, quarantine and a report.

Order of operations (each row lands in one bucket, see report.py):
  1. read every source, normalize each row; rows that cannot be normalized are quarantined;
  2. exact dedupe on prompt_id (the copy kept is the one with the smallest (domain, source), so
     the result does not depend on input order);
  3. token-length filter with the caller's `count_tokens`;
  4. group by normalized-text hash; each group's smallest prompt_id represents it;
  5. hold out `holdout_per_domain` representatives per domain (seeded);
  6. decontaminate: the other members of a held-out group are dropped as "contaminated";
     the other members of every remaining group as "duplicates_normalized";
  7. the mixture caps each domain (seeded), the rest is "over_quota".
Decontamination is exact on the normalized text only: an n-gram overlap check would also drop
every prompt sharing a long system prompt or tool boilerplate with a held-out one.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from tasks.config import DiscoverConfig, SourceConfig
from tasks.discover.formats import (
    MalformedRow,
    Messages,
    canonical_json,
    normalize_row,
    normalized_hash,
    prompt_id_of,
)
from tasks.discover.mixture import (
    DiscoverConfigError,
    check_mixture_config,
    domain_caps,
    seeded_pick,
)
from tasks.discover.report import build_report, empty_counts, reason_kinds
from tasks.discover.result import (
    MANIFEST_SCHEMA,
    QUARANTINE_SCHEMA,
    DiscoveryResult,
    truncate_raw,
)
from tasks.discover.sources import SourceReader, redact

CountTokens = Callable[[Messages], int]


@dataclass
class _Prompt:
    prompt_id: str
    source: str
    domain: str
    row_index: int
    messages: Messages
    n_tokens: int = 0

    def rank(self) -> tuple[str, str, int]:
        return (self.domain, self.source, self.row_index)

    def record(self) -> dict[str, Any]:
        return {
            "prompt_id": self.prompt_id,
            "source": self.source,
            "domain": self.domain,
            "messages": canonical_json(self.messages),
            "n_tokens": self.n_tokens,
        }


def _raw_json(row: Any) -> str:
    return json.dumps(row, ensure_ascii=False, default=str)


def check_discover_config(cfg: DiscoverConfig) -> None:
    if not cfg.sources:
        raise DiscoverConfigError("discover.sources is empty: declare at least one source")
    seen: dict[str, int] = {}
    for i, src in enumerate(cfg.sources):
        if src.name in seen:
            raise DiscoverConfigError(
                f"discover.sources[{i}].name {src.name!r} is already used by "
                f"discover.sources[{seen[src.name]}]"
            )
        seen[src.name] = i
    if cfg.min_prompt_tokens > cfg.max_prompt_tokens:
        raise DiscoverConfigError(
            f"discover.min_prompt_tokens ({cfg.min_prompt_tokens}) is above "
            f"discover.max_prompt_tokens ({cfg.max_prompt_tokens})"
        )
    check_mixture_config(cfg)


class _Discovery:
    """One run of the stage: the state the steps share."""

    def __init__(self, cfg: DiscoverConfig, count_tokens: CountTokens) -> None:
        self.cfg = cfg
        self.count_tokens = count_tokens
        self.counts = {s.name: empty_counts() for s in cfg.sources}
        self.quarantine: list[dict[str, Any]] = []
        self.prompts: dict[str, _Prompt] = {}
        self.warnings: list[str] = []

    def drop(self, p: _Prompt, outcome: str) -> None:
        self.counts[p.source][outcome] += 1

    def quarantine_row(self, src: SourceConfig, row_index: int, reason: str, raw: str) -> None:
        self.counts[src.name]["malformed"] += 1
        self.quarantine.append(
            {
                "source": src.name,
                "domain": src.domain,
                "row_index": row_index,
                "reason": reason,
                "raw": truncate_raw(raw),
            }
        )

    def read(self, src: SourceConfig, storage_options: dict[str, Any] | None) -> None:
        for raw in SourceReader(src, storage_options).rows():
            self.counts[src.name]["rows_read"] += 1
            if raw.error is not None:
                self.quarantine_row(src, raw.row_index, raw.error, raw.raw_text or "")
                continue
            try:
                messages = normalize_row(raw.row, src.conversation_format)
            except MalformedRow as e:
                self.quarantine_row(src, raw.row_index, str(e), _raw_json(raw.row))
                continue
            p = _Prompt(prompt_id_of(messages), src.name, src.domain, raw.row_index, messages)
            kept = self.prompts.setdefault(p.prompt_id, p)
            if kept is not p:
                winner, loser = sorted((kept, p), key=_Prompt.rank)
                self.prompts[p.prompt_id] = winner
                self.drop(loser, "duplicates_exact")

    def filter_lengths(self) -> list[_Prompt]:
        sources = {s.name: s for s in self.cfg.sources}
        passed: list[_Prompt] = []
        failures: list[Exception] = []
        for pid in sorted(self.prompts):
            p = self.prompts[pid]
            try:
                n = self.count_tokens(p.messages)
            except Exception as e:  # a chat template that rejects this conversation
                failures.append(e)
                reason = f"token count failed: {type(e).__name__}: {e}"
                self.quarantine_row(
                    sources[p.source], p.row_index, reason, canonical_json(p.messages)
                )
                continue
            try:
                n = operator.index(n)  # numpy integers pass, floats and None do not
            except TypeError:
                raise TypeError(
                    f"count_tokens returned {type(n).__name__}, expected an int"
                ) from None
            p.n_tokens = n
            if n < self.cfg.min_prompt_tokens:
                self.drop(p, "too_short")
            elif n > self.cfg.max_prompt_tokens:
                self.drop(p, "too_long")
            else:
                passed.append(p)
        if failures and len(failures) == len(self.prompts):
            raise RuntimeError(
                f"count_tokens failed on all {len(failures)} prompts; first: {failures[0]!r}"
            ) from failures[0]
        return passed

    def split(self, passed: list[_Prompt]) -> tuple[list[_Prompt], list[_Prompt]]:
        """Holdout, then decontamination and normalized dedupe; returns (holdout, remaining)."""
        groups: dict[str, list[_Prompt]] = {}
        for p in passed:  # sorted by prompt_id, so each group's first member is its smallest
            groups.setdefault(normalized_hash(p.messages), []).append(p)
        reps_by_domain: dict[str, list[str]] = {}
        for members in groups.values():
            reps_by_domain.setdefault(members[0].domain, []).append(members[0].prompt_id)
        k = self.cfg.holdout_per_domain
        held: set[str] = set()
        for domain, ids in sorted(reps_by_domain.items()):
            if k and len(ids) <= k:
                self.warnings.append(
                    f"domain {domain!r}: only {len(ids)} distinct prompt(s) after filtering, "
                    f"all held out (holdout_per_domain {k}); none left for training"
                )
            held |= seeded_pick(ids, k, self.cfg.seed, "holdout", domain)
        holdout: list[_Prompt] = []
        remaining: list[_Prompt] = []
        for members in groups.values():
            rep, others = members[0], members[1:]
            is_held = rep.prompt_id in held
            (holdout if is_held else remaining).append(rep)
            for p in others:
                self.drop(p, "contaminated" if is_held else "duplicates_normalized")
        for p in holdout:
            self.drop(p, "holdout")
        return holdout, remaining

    def mix(self, remaining: list[_Prompt]) -> tuple[list[_Prompt], dict[str, dict[str, Any]]]:
        by_domain: dict[str, list[_Prompt]] = {s.domain: [] for s in self.cfg.sources}
        for p in remaining:
            by_domain.setdefault(p.domain, []).append(p)
        caps = domain_caps(self.cfg, {d: len(ps) for d, ps in by_domain.items()})
        kept: list[_Prompt] = []
        mixture: dict[str, dict[str, Any]] = {}
        for domain, ps in sorted(by_domain.items()):
            cap = caps[domain]
            if cap is not None and cap > len(ps):
                self.warnings.append(f"domain {domain!r}: cap {cap}, only {len(ps)} available")
            k = len(ps) if cap is None else cap
            chosen = seeded_pick((p.prompt_id for p in ps), k, self.cfg.seed, "mixture", domain)
            for p in ps:
                if p.prompt_id in chosen:
                    kept.append(p)
                    self.drop(p, "kept")
                else:
                    self.drop(p, "over_quota")
            mixture[domain] = {"available": len(ps), "cap": cap, "kept": len(chosen)}
        return kept, mixture

    def mixture_mode(self) -> str:
        cfg = self.cfg
        if cfg.domain_weights:
            return "quotas + weights" if cfg.domain_quotas else "weights"
        if cfg.domain_quotas:
            return "quotas + total_prompts" if cfg.total_prompts else "quotas"
        return "total_prompts (proportional)" if cfg.total_prompts else "keep all"


def _table(prompts: list[_Prompt]) -> pa.Table:
    rows = [p.record() for p in sorted(prompts, key=lambda p: p.prompt_id)]
    return pa.Table.from_pylist(rows, schema=MANIFEST_SCHEMA)


def discover_prompts(
    cfg: DiscoverConfig,
    count_tokens: CountTokens,
    storage_options: dict[str, Any] | None = None,
) -> DiscoveryResult:
    """Read, normalize, dedupe, filter, hold out and mix the configured prompt sources."""
    check_discover_config(cfg)
    run = _Discovery(cfg, count_tokens)
    for src in cfg.sources:
        run.read(src, storage_options)
    holdout, remaining = run.split(run.filter_lengths())
    kept, mixture = run.mix(remaining)
    for name, c in run.counts.items():
        if c["rows_read"] and not c["kept"]:
            run.warnings.append(f"source {name!r}: none of its {c['rows_read']} rows was kept")
    sources_info = {
        s.name: {
            "domain": s.domain,
            "path": redact(s.path),
            "file_format": s.file_format,
            "conversation_format": s.conversation_format,
        }
        for s in cfg.sources
    }
    settings = {
        "seed": cfg.seed,
        "min_prompt_tokens": cfg.min_prompt_tokens,
        "max_prompt_tokens": cfg.max_prompt_tokens,
        "holdout_per_domain": cfg.holdout_per_domain,
        "total_prompts": cfg.total_prompts,
        "domain_quotas": dict(cfg.domain_quotas),
        "domain_weights": dict(cfg.domain_weights),
        "mixture_mode": run.mixture_mode(),
    }
    reasons = reason_kinds(q["reason"] for q in run.quarantine)
    report = build_report(sources_info, run.counts, mixture, settings, run.warnings, reasons)
    quarantine = sorted(run.quarantine, key=lambda q: (q["source"], q["row_index"]))
    return DiscoveryResult(
        manifest=_table(kept),
        holdout=_table(holdout),
        quarantine=pa.Table.from_pylist(quarantine, schema=QUARANTINE_SCHEMA),
        report=report,
    )
