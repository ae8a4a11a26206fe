"""discover_prompts: configured sources -> manifest, holdout, quarantine, filtered and a report.

Order of operations (each row lands in one bucket, see report.py):
  0. every source is resolved (package:// paths, globs, folders) before any is read, so a
     missing package or file fails before the first large file is parsed;
  1. read every source, normalize each row into its prompts (RowOptions: prompt turns, system
     turns, template); rows that cannot be normalized are quarantined; the domain rules give
     each prompt its domain. With prompt_turns every_user a row gives one prompt per user turn,
     and each prompt (or the broken turn that ended them) is a row of the funnel. A synthesized
     source's rows are its slots (synthesized.py): a dead letter is quarantined, and an empty,
     truncated, non-text or refusal-like request is filtered before it is a prompt;
  2. script filter (`min_latin_fraction`), per source;
  3. exact dedupe on the dedupe key (the copy kept is the one with the smallest
     (domain, synthesized, source, row): a real prompt before a synthesized copy of it, and the
     result does not depend on input order);
  4. token-length filter with the caller's `count_tokens`;
  5. group by normalized-text hash of the dedupe key; each group's smallest prompt_id
     represents it;
  6. hold out `holdout_per_domain` representatives per domain (seeded, among real prompts only:
     the gate measures what users send), or, with
     `holdout_from`, exactly the prompts of an earlier run's holdout table (holdout_from.py): those
     among the candidates here are held out with the domain recorded there, the others as
     recorded there (the report warns);
  7. decontaminate: the other members of a held-out group, and every other prompt of a held-out
     prompt's conversation (every_user), are dropped as "contaminated"; the other members of
     every remaining group as "duplicates_normalized" (a real member kept before a synthesized one);
  7b. synthesized prompts only (near_duplicates.py): one near a held-out prompt is "near_holdout"
     (strict: exact overlap with every held-out prompt, holdout_from's carried ones included), then
     one near a remaining real prompt or an earlier synthesized one is "near_duplicate";
  8. the mixture caps each domain (seeded), the rest is "over_quota".
Every row left out in 2-8 is a record of the filtered table (reason, detail, tokens); the
report's counts are derived from the records. Decontamination of real prompts is exact on the
normalized text only: an n-gram overlap check would also drop every prompt sharing a long system
prompt or tool boilerplate with a held-out one. Synthesized prompts, written by the target with
nothing to stop it from writing a benchmark prompt again, are also checked for near-copies, on
their user turns alone.
"""

from __future__ import annotations

import json
import operator
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa

from tasks.config import DiscoverConfig, SourceConfig
from tasks.config.sections import SYNTHESIS_KEYS
from tasks.discover.domains import (
    DomainRules,
    declared_domains,
    max_prompt_setting,
    max_prompt_tokens,
    source_domains,
)
from tasks.discover.formats import (
    MalformedRow,
    Messages,
    RowOptions,
    canonical_json,
    normalized_hash,
    prompt_id_of,
    row_prompts,
    user_turns,
)
from tasks.discover.holdout_from import PinnedHoldout, load_pinned_holdout
from tasks.discover.mixture import (
    DiscoverConfigError,
    check_mixture_config,
    domain_caps,
    seeded_pick,
)
from tasks.discover.near_duplicates import HeldOutGuard, NearDuplicates, shingles
from tasks.discover.report import build_report, funnel_counts, reason_kinds
from tasks.discover.result import (
    FILTERED_SCHEMA,
    MANIFEST_SCHEMA,
    QUARANTINE_SCHEMA,
    DiscoveryResult,
    truncate_raw,
)
from tasks.discover.script import latin_fraction
from tasks.discover.sources import SourceReader
from tasks.discover.synthesized import (
    SynthesizedRequest,
    SynthesizedSet,
    request_messages,
    request_problem,
)
from tasks.redaction import redact_url

CountTokens = Callable[[Messages], int]
_CARRIED_IDS_NAMED = 5  # the held-out prompts a warning names, of those kept as recorded


@dataclass
class _Prompt:
    prompt_id: str
    source: str
    domain: str
    row_index: int
    user_turn: int | None  # with prompt_turns every_user, the user turn the prompt ends at
    messages: Messages
    n_tokens: int | None = None
    synthesized: bool = False  # written by the target (a synthesized source's slot)

    def rank(self) -> tuple[str, bool, str, int, int]:
        # A real prompt before a synthesized copy of it: the real one is what users send.
        return (self.domain, self.synthesized, self.source, self.row_index, self.user_turn or 0)

    def conversation(self) -> tuple[str, int]:
        return (self.source, self.row_index)

    def where(self) -> str:
        turn = "" if self.user_turn is None else f" turn {self.user_turn}"
        return f"{self.prompt_id} ({self.source} row {self.row_index}{turn})"

    def record(self) -> dict[str, Any]:
        return {
            "prompt_id": self.prompt_id,
            "source": self.source,
            "domain": self.domain,
            "messages": canonical_json(self.messages),
            "n_tokens": self.n_tokens,
        }


def _record_order(record: dict[str, Any]) -> tuple[str, int, int]:
    """Quarantine and filtered records in source order: row, then user turn (every_user)."""
    return (record["source"], record["row_index"], record["user_turn"] or 0)


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
    domains = declared_domains(cfg)
    for domain, cap in cfg.max_prompt_tokens_by_domain.items():
        if domain not in domains:
            raise DiscoverConfigError(
                f"discover.max_prompt_tokens_by_domain: domain {domain!r} is not the domain of any "
                f"source or domain rule (domains: {domains})"
            )
        if cap < max(1, cfg.min_prompt_tokens):
            raise DiscoverConfigError(
                f"discover.max_prompt_tokens_by_domain.{domain} ({cap}) is below "
                f"discover.min_prompt_tokens ({cfg.min_prompt_tokens}) or 1"
            )
    check_mixture_config(cfg)


class _Discovery:
    """One run of the stage: the state the steps share."""

    def __init__(
        self, cfg: DiscoverConfig, count_tokens: CountTokens, pinned: PinnedHoldout | None
    ) -> None:
        self.cfg = cfg
        self.count_tokens = count_tokens
        self.pinned = pinned
        # Every read of a pinned held-out prompt, whatever became of it (holdout_from).
        self.pinned_reads: list[_Prompt] = []
        # Rows of the funnel: one per prompt given or row quarantined (report.py). A source's
        # rows as read differ from them with prompt_turns every_user only.
        self.rows_read = {s.name: 0 for s in cfg.sources}
        self.source_rows = {s.name: 0 for s in cfg.sources}
        self.quarantine: list[dict[str, Any]] = []
        self.filtered: list[dict[str, Any]] = []
        self.prompts: dict[str, _Prompt] = {}  # dedupe key -> the copy kept
        self.warnings: list[str] = []

    def dedupe_messages(self, messages: Messages) -> Messages:
        return user_turns(messages) if self.cfg.dedupe_key == "user_turns" else messages

    def drop(self, p: _Prompt, reason: str, detail: str, **extra: Any) -> None:
        self.filtered.append(
            {
                "source": p.source,
                "domain": p.domain,
                "row_index": p.row_index,
                "user_turn": p.user_turn,
                "prompt_id": p.prompt_id,
                "reason": reason,
                "detail": detail,
                "n_tokens": p.n_tokens,
                "latin_fraction": extra.get("latin_fraction"),
                "duplicate_of": extra.get("duplicate_of"),
            }
        )

    def quarantine_row(
        self,
        source: str,
        domain: str,
        row_index: int,
        reason: str,
        raw: str,
        user_turn: int | None = None,
    ) -> None:
        self.quarantine.append(
            {
                "source": source,
                "domain": domain,
                "row_index": row_index,
                "user_turn": user_turn,
                "reason": reason,
                "raw": truncate_raw(raw),
            }
        )

    def read(self, reader: SourceReader) -> None:
        src = reader.src
        options = RowOptions(src.prompt_turns, src.system_turns, src.user_template)
        rules = DomainRules(src)
        for raw in reader.rows():
            self.source_rows[src.name] += 1
            if raw.error is not None:
                self.rows_read[src.name] += 1
                self.quarantine_row(
                    src.name, src.domain, raw.row_index, raw.error, raw.raw_text or ""
                )
                continue
            try:
                for user_turn, messages in row_prompts(raw.row, src.conversation_format, options):
                    self.rows_read[src.name] += 1
                    self.take(
                        src,
                        _Prompt(
                            prompt_id_of(messages),
                            src.name,
                            rules.domain_of(messages),
                            raw.row_index,
                            user_turn,
                            messages,
                        ),
                    )
            except MalformedRow as e:
                self.rows_read[src.name] += 1
                self.quarantine_row(
                    src.name, src.domain, raw.row_index, str(e), _raw_json(raw.row), e.user_turn
                )
        self.warnings += [f"source {src.name!r}: {w}" for w in reader.warnings]
        if not self.source_rows[src.name]:
            # Its domain would vanish from the mixture with nothing but a count of 0 to show.
            raise reader.fail("holds no rows (an empty file?); fill it, or remove the source")

    def read_synthesized(self, src: SourceConfig, requests: list[SynthesizedRequest]) -> None:
        """A synthesized source's slots, each a row of the funnel: a dead letter is quarantined,
        a request that cannot be a prompt is filtered with its reason, the rest is taken."""
        rules = DomainRules(src)
        for r in requests:
            self.source_rows[src.name] += 1
            self.rows_read[src.name] += 1
            if r.error is not None:
                raw = _raw_json({"request_id": r.request_id, "error": r.error})
                self.quarantine_row(src.name, src.domain, r.index, f"synthesis failed: {r.error}", raw)
                continue
            messages = request_messages(src, r)
            p = _Prompt(prompt_id_of(messages), src.name, rules.domain_of(messages), r.index, None, messages,
                        synthesized=True)  # fmt: skip
            problem = request_problem(src, r)
            if problem is None:
                self.take(src, p)
            else:
                self.drop(p, *problem)

    def take(self, src: SourceConfig, p: _Prompt) -> None:
        """One prompt read: the script filter, then exact dedupe (the smallest rank stays)."""
        if self.pinned is not None and p.prompt_id in self.pinned.rows:
            self.pinned_reads.append(p)
        if not self.passes_script(src, p):
            return
        key = prompt_id_of(self.dedupe_messages(p.messages))
        kept = self.prompts.setdefault(key, p)
        if kept is not p:
            winner, loser = sorted((kept, p), key=_Prompt.rank)
            self.prompts[key] = winner
            self.drop(
                loser,
                "duplicates_exact",
                f"same {self.cfg.dedupe_key} as {winner.where()}",
                duplicate_of=winner.prompt_id,
            )

    def passes_script(self, src: SourceConfig, p: _Prompt) -> bool:
        if src.min_latin_fraction is None:
            return True
        fraction = latin_fraction(p.messages)
        if fraction is None or fraction >= src.min_latin_fraction:
            return True
        self.drop(
            p,
            "non_latin",
            f"Latin-script letters are {fraction:.3f} of the prompt's letters, below "
            f"min_latin_fraction {src.min_latin_fraction}",
            latin_fraction=fraction,
        )
        return False

    def filter_lengths(self) -> list[_Prompt]:
        passed: list[_Prompt] = []
        failures: list[Exception] = []
        lo = self.cfg.min_prompt_tokens
        for p in sorted(self.prompts.values(), key=lambda p: p.prompt_id):
            try:
                n = self.count_tokens(p.messages)
            except Exception as e:  # a chat template that rejects this conversation
                failures.append(e)
                reason = f"token count failed: {type(e).__name__}: {e}"
                self.quarantine_row(
                    p.source, p.domain, p.row_index, reason, canonical_json(p.messages), p.user_turn
                )
                continue
            try:
                n = operator.index(n)  # numpy integers pass, floats and None do not
            except TypeError:
                raise TypeError(
                    f"count_tokens returned {type(n).__name__}, expected an int"
                ) from None
            p.n_tokens = n
            if n < lo:
                self.drop(p, "too_short", f"{n} tokens, below min_prompt_tokens {lo}")
            elif n > max_prompt_tokens(self.cfg, p.domain):
                self.drop(p, "too_long", f"{n} tokens, above {max_prompt_setting(self.cfg, p.domain)}")
            else:
                passed.append(p)
        if failures and len(failures) == len(self.prompts):
            raise RuntimeError(
                f"count_tokens failed on all {len(failures)} prompts; first: {failures[0]!r}"
            ) from failures[0]
        return passed

    def split(
        self, passed: list[_Prompt]
    ) -> tuple[list[_Prompt], list[dict[str, Any]], list[_Prompt]]:
        """Holdout, then decontamination and normalized dedupe; returns (holdout, the pinned
        held-out rows that are no candidate here, remaining)."""
        groups: dict[str, list[_Prompt]] = {}
        for p in passed:  # sorted by prompt_id, so each group's first member is its smallest
            groups.setdefault(normalized_hash(self.dedupe_messages(p.messages)), []).append(p)
        carried: list[dict[str, Any]] = []
        held_elsewhere: dict[str, tuple[str, str]] = {}  # normalized hash -> (prompt_id, where)
        if self.pinned is None:
            held = self.seeded_holdout(groups)
            held_reads = [p for members in groups.values() for p in members if p.prompt_id in held]
        else:
            held = set(self.pinned.rows)
            # Every read, not only the candidates: a later turn may pass a filter that the
            # held-out prompt failed (more Latin text after it), and it still holds the prompt.
            held_reads = self.pinned_reads
            carried, held_elsewhere = self.pinned_elsewhere(
                self.pinned, {p.prompt_id for p in passed}
            )
            pinned_domains = self.pinned.per_domain()
            for domain in declared_domains(self.cfg):
                if domain not in pinned_domains:
                    self.warnings.append(
                        f"domain {domain!r}: holdout_from holds none of its prompts, so the gate "
                        "measures none of it (holdout_per_domain picks nothing with holdout_from)"
                    )
        # A held-out prompt's conversation gives no training prompt (every_user): its earlier
        # turns would be the held-out prompt's context, its later ones would hold the prompt.
        held_in: dict[tuple[str, int], _Prompt] = {}
        for p in held_reads:
            held_in.setdefault(p.conversation(), p)
        holdout: list[_Prompt] = []
        remaining: list[_Prompt] = []
        for key, members in groups.items():
            held_here = [p for p in members if p.prompt_id in held]
            holdout += [self.as_held(p) for p in held_here]
            if held_here:
                like: tuple[str, str] | None = (held_here[0].prompt_id, held_here[0].where())
            else:
                like = held_elsewhere.get(key)
            if like is not None:
                for p in members:
                    if p.prompt_id not in held:
                        detail = f"normalized text equals held-out {like[1]}"
                        self.drop(p, "contaminated", detail, duplicate_of=like[0])
                continue
            free = []
            for p in sorted(members, key=lambda p: p.synthesized):  # a real member is the one kept
                sibling = held_in.get(p.conversation())
                if sibling is None:
                    free.append(p)
                else:
                    detail = f"from the conversation of held-out {sibling.where()}"
                    self.drop(p, "contaminated", detail, duplicate_of=sibling.prompt_id)
            if free:
                remaining.append(free[0])
            for p in free[1:]:
                detail = f"normalized text equals {free[0].where()}"
                self.drop(p, "duplicates_normalized", detail, duplicate_of=free[0].prompt_id)
        return holdout, carried, remaining

    def seeded_holdout(self, groups: dict[str, list[_Prompt]]) -> set[str]:
        """`holdout_per_domain` group representatives per domain, seeded (prompt ids). Each group's
        first real member represents it: a synthesized prompt is never held out (the gate
        measures the prompts users send), and a group of synthesized prompts alone is no
        candidate."""
        reps_by_domain: dict[str, list[str]] = {}
        for members in groups.values():
            rep = next((p for p in members if not p.synthesized), None)
            if rep is not None:
                reps_by_domain.setdefault(rep.domain, []).append(rep.prompt_id)
        k = self.cfg.holdout_per_domain
        held: set[str] = set()
        for domain, ids in sorted(reps_by_domain.items()):
            if k and len(ids) <= k:
                self.warnings.append(
                    f"domain {domain!r}: only {len(ids)} distinct prompt(s) after filtering, "
                    f"all held out (holdout_per_domain {k}); none left for training"
                )
            held |= seeded_pick(ids, k, self.cfg.seed, "holdout", domain)
        return held

    def as_held(self, p: _Prompt) -> _Prompt:
        """A held-out prompt; a pinned one keeps the domain its table records (rules may differ)."""
        if self.pinned is None:
            return p
        return replace(p, domain=self.pinned.rows[p.prompt_id]["domain"])

    def pinned_elsewhere(
        self, pinned: PinnedHoldout, candidates: set[str]
    ) -> tuple[list[dict[str, Any]], dict[str, tuple[str, str]]]:
        """The pinned held-out rows that are no candidate here (filtered, or never read), still
        held out as recorded so the benchmark does not shrink; and each one's normalized hash ->
        (prompt_id, where), so that a candidate copy of it is decontaminated."""
        first_read = {p.prompt_id: p for p in reversed(self.pinned_reads)}
        carried: list[dict[str, Any]] = []
        held_elsewhere: dict[str, tuple[str, str]] = {}
        for prompt_id, row in sorted(pinned.rows.items()):
            if prompt_id in candidates:
                continue
            carried.append(row)
            read = first_read.get(prompt_id)
            where = f"{prompt_id} (not read in this run)" if read is None else read.where()
            key = normalized_hash(self.dedupe_messages(json.loads(row["messages"])))
            held_elsewhere.setdefault(key, (prompt_id, where))
        if carried:
            ids = [row["prompt_id"] for row in carried]
            filtered = sum(1 for i in ids if i in first_read)
            more = ", ..." if len(ids) > _CARRIED_IDS_NAMED else ""
            self.warnings.append(
                f"holdout_from: {len(ids)} of {len(pinned.rows)} held-out prompt(s) are not "
                f"among this run's candidates ({filtered} read and filtered, "
                f"{len(ids) - filtered} not read) and are held out as {pinned.table_path} "
                f"records them: {', '.join(ids[:_CARRIED_IDS_NAMED])}{more}"
            )
        return carried, held_elsewhere

    def filter_near(
        self, remaining: list[_Prompt], holdout: list[_Prompt], carried: list[dict[str, Any]]
    ) -> list[_Prompt]:
        """Synthesized prompts near a held-out prompt (strictly) or near a prompt kept before them
        (a remaining real one, or an earlier synthesized one, in rank order) are filtered."""
        synthesized = sorted((p for p in remaining if p.synthesized), key=_Prompt.rank)
        if not synthesized:
            return remaining
        cfg = self.cfg
        held = [(p.prompt_id, p.messages) for p in holdout]
        held += [(row["prompt_id"], json.loads(row["messages"])) for row in carried]
        guard = HeldOutGuard(held, cfg.holdout_near_threshold)
        kept = [p for p in remaining if not p.synthesized]
        order = kept + synthesized  # the real ones are kept whatever comes after them
        index = NearDuplicates([p.prompt_id for p in order], [shingles(p.messages) for p in order],
                               cfg.near_duplicate_threshold)  # fmt: skip
        for i in range(len(kept)):
            index.keep(i)
        for i, p in enumerate(synthesized, start=len(kept)):
            if (hit := guard.match(index.sets[i])) is not None:
                detail = (f"overlap {hit.similarity:.2f} of word 3-grams with held-out {hit.key}, at or above "
                          f"holdout_near_threshold {cfg.holdout_near_threshold}")  # fmt: skip
                self.drop(p, "near_holdout", detail, duplicate_of=hit.key)
            elif (hit := index.match(i)) is not None:
                detail = (f"Jaccard {hit.similarity:.2f} of word 3-grams with {hit.key}, at or above "
                          f"near_duplicate_threshold {cfg.near_duplicate_threshold}")  # fmt: skip
                self.drop(p, "near_duplicate", detail, duplicate_of=hit.key)
            else:
                index.keep(i)
                kept.append(p)
        return kept

    def mix(self, remaining: list[_Prompt]) -> tuple[list[_Prompt], dict[str, dict[str, Any]]]:
        by_domain: dict[str, list[_Prompt]] = {d: [] for d in declared_domains(self.cfg)}
        for p in remaining:
            by_domain[p.domain].append(p)
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
                else:
                    self.drop(
                        p, "over_quota", f"domain {domain!r} keeps {cap} of {len(ps)} available"
                    )
            mixture[domain] = {"available": len(ps), "cap": cap, "kept": len(chosen)}
        return kept, mixture

    def mixture_mode(self) -> str:
        cfg = self.cfg
        if cfg.domain_weights:
            return "quotas + weights" if cfg.domain_quotas else "weights"
        if cfg.domain_quotas:
            return "quotas + total_prompts" if cfg.total_prompts else "quotas"
        return "total_prompts (proportional)" if cfg.total_prompts else "keep all"


def _table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(
        sorted(rows, key=lambda row: row["prompt_id"]), schema=MANIFEST_SCHEMA
    )


def _source_info(src: SourceConfig) -> dict[str, Any]:
    common = {
        "kind": src.kind,
        "domain": src.domain,
        "system_turns": src.system_turns,
        "min_latin_fraction": src.min_latin_fraction,
        "domain_rules": [r.model_dump() for r in src.domain_rules],
    }
    if src.kind == "synthesized":  # its settings nested: the source's numbers stay its funnel counts
        return {**common, "synthesis": {k: getattr(src, k) for k in SYNTHESIS_KEYS}}
    return {
        **common,
        "path": redact_url(src.path or ""),
        "file_format": src.file_format,
        "conversation_format": src.conversation_format,
        "prompt_turns": src.prompt_turns,
        "user_template": src.user_template,
    }


def _synthesized_requests(cfg: DiscoverConfig, synthesized: SynthesizedSet | None) -> dict[str, list[SynthesizedRequest]]:
    """Each synthesized source's slots, refused before any source is read when the synthesis did
    not give them (discovery of such a config runs through tasks/synthesize/, as the flow does)."""
    given = {} if synthesized is None else synthesized.requests
    out: dict[str, list[SynthesizedRequest]] = {}
    for src in cfg.synthesized():
        if src.name not in given:
            raise DiscoverConfigError(
                f"source {src.name!r} is synthesized, but no synthesis was given for it: run "
                "discovery through tasks.synthesize.stage.discover_with_synthesis (the discover flow does)"
            )
        out[src.name] = sorted(given[src.name], key=lambda r: r.index)
    return out


def _settings(cfg: DiscoverConfig, run: _Discovery) -> dict[str, Any]:
    settings = {
        "seed": cfg.seed,
        "min_prompt_tokens": cfg.min_prompt_tokens,
        "max_prompt_tokens": cfg.max_prompt_tokens,
        "max_prompt_tokens_by_domain": dict(cfg.max_prompt_tokens_by_domain),
        "holdout_per_domain": cfg.holdout_per_domain,
        "holdout_from": None if cfg.holdout_from is None else redact_url(cfg.holdout_from),
        "total_prompts": cfg.total_prompts,
        "domain_quotas": dict(cfg.domain_quotas),
        "domain_weights": dict(cfg.domain_weights),
        "dedupe_key": cfg.dedupe_key,
        "mixture_mode": run.mixture_mode(),
    }
    if cfg.synthesized():
        settings["near_duplicate_threshold"] = cfg.near_duplicate_threshold
        settings["holdout_near_threshold"] = cfg.holdout_near_threshold
    return settings


def _synthesis_info(cfg: DiscoverConfig, kept: list[_Prompt], synthesized: SynthesizedSet | None) -> dict[str, Any] | None:
    """The kept prompts per domain, real beside synthesized, and the synthesis' own summary."""
    if not cfg.synthesized():
        return None
    by_domain = {d: {"real": 0, "synthesized": 0} for d in declared_domains(cfg)}
    for p in kept:
        by_domain[p.domain]["synthesized" if p.synthesized else "real"] += 1
    return {"kept_by_domain": by_domain, "summary": dict(synthesized.summary) if synthesized else {}}


def _report(cfg: DiscoverConfig, run: _Discovery, parts: dict[str, Any], synthesized: SynthesizedSet | None) -> dict[str, Any]:
    """The report of one discovery, from its records (`parts`: the tables' rows and the mixture)."""
    quarantine, filtered, holdout, kept = parts["quarantine"], parts["filtered"], parts["holdout"], parts["kept"]
    outcomes = [
        *((q["source"], q["domain"], "malformed") for q in quarantine),
        *((f["source"], f["domain"], f["reason"]) for f in filtered),
        *((p.source, p.domain, "holdout") for p in holdout),
        *((p.source, p.domain, "kept") for p in kept),
    ]
    counts = funnel_counts({s.name: source_domains(s) for s in cfg.sources}, run.rows_read, outcomes)
    for name, by_domain in counts.items():
        if run.source_rows[name] and not any(c["kept"] for c in by_domain.values()):
            run.warnings.append(f"source {name!r}: none of its {run.source_rows[name]} rows was kept")
    settings = _settings(cfg, run)
    holdout_from = None
    if run.pinned is not None:
        holdout_from = {
            "path": settings["holdout_from"],
            "table": run.pinned.table_path,
            "prompt_ids_hash": run.pinned.ids_hash(),
            "carried_per_domain": dict(Counter(row["domain"] for row in parts["carried"])),
        }
    return build_report(
        {s.name: {**_source_info(s), "source_rows": run.source_rows[s.name]} for s in cfg.sources},
        counts,
        parts["mixture"],
        settings,
        run.warnings,
        reason_kinds(q["reason"] for q in quarantine),
        holdout_from,
        _synthesis_info(cfg, kept, synthesized),
    )


def discover_prompts(
    cfg: DiscoverConfig,
    count_tokens: CountTokens,
    storage_options: dict[str, Any] | None = None,
    pinned: PinnedHoldout | None = None,
    synthesized: SynthesizedSet | None = None,
) -> DiscoveryResult:
    """Read, normalize, filter, dedupe, hold out and mix the configured prompt sources.

    `pinned`: the held-out set of `cfg.holdout_from` when the caller has read it already (the
    stage does, for its config hash); otherwise it is read here, before any source.
    `synthesized`: what the synthesis of the config's synthesized sources committed (required
    when it has any)."""
    check_discover_config(cfg)
    pinned = pinned or load_pinned_holdout(cfg, storage_options)
    readers = {src.name: SourceReader(src, storage_options) for src in cfg.sources if src.kind == "file"}
    for reader in readers.values():
        reader.plan()
    requests = _synthesized_requests(cfg, synthesized)
    run = _Discovery(cfg, count_tokens, pinned)
    for src in cfg.sources:
        if src.kind == "file":
            run.read(readers[src.name])
        else:
            run.read_synthesized(src, requests[src.name])
    holdout, carried, remaining = run.split(run.filter_lengths())
    kept, mixture = run.mix(run.filter_near(remaining, holdout, carried))
    parts = {"quarantine": sorted(run.quarantine, key=_record_order), "filtered": sorted(run.filtered, key=_record_order),
             "holdout": holdout, "carried": carried, "kept": kept, "mixture": mixture}  # fmt: skip
    return DiscoveryResult(
        manifest=_table([p.record() for p in kept]),
        holdout=_table([p.record() for p in holdout] + carried),
        quarantine=pa.Table.from_pylist(parts["quarantine"], schema=QUARANTINE_SCHEMA),
        filtered=pa.Table.from_pylist(parts["filtered"], schema=FILTERED_SCHEMA),
        report=_report(cfg, run, parts, synthesized),
    )
