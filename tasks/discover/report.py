"""The discovery funnel: where every row read went, per source, per domain and in total.

Each row read lands in exactly one bucket, in the order the stage applies them, so for every
source `rows_read` equals the sum of the other counts (with prompt_turns every_user a row gives
one funnel row per prompt, and the source's `source_rows` says how many rows it had):
malformed -> empty / truncated / non_text / refusal -> non_latin -> duplicates_exact -> too_short /
too_long -> holdout -> contaminated -> duplicates_normalized -> near_holdout -> near_duplicate ->
over_quota -> kept. The synthesized-only outcomes (SYNTHESIZED_OUTCOMES) are columns of the
markdown only when the discovery had a synthesized source.
The counts are never kept on the side: `funnel_counts` derives them from the row records the
stage writes (quarantine, filtered, holdout, manifest), so the report cannot disagree with them.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

OUTCOMES = (
    "malformed",
    "empty",
    "truncated",
    "non_text",
    "refusal",
    "non_latin",
    "duplicates_exact",
    "too_short",
    "too_long",
    "holdout",
    "contaminated",
    "duplicates_normalized",
    "near_holdout",
    "near_duplicate",
    "over_quota",
    "kept",
)
# What only a synthesized source's prompts can meet (tasks/discover/synthesized.py, near_duplicates.py).
SYNTHESIZED_OUTCOMES = ("empty", "truncated", "non_text", "refusal", "near_holdout", "near_duplicate")
COUNT_KEYS = ("rows_read", *OUTCOMES)
# The outcomes recorded in the filtered table (valid prompts left out by a setting).
FILTERED_OUTCOMES = tuple(o for o in OUTCOMES if o not in ("malformed", "holdout", "kept"))

_HEADERS = {
    "rows_read": "read",
    "malformed": "malformed",
    "non_latin": "non-Latin",
    "duplicates_exact": "dup exact",
    "too_short": "too short",
    "too_long": "too long",
    "holdout": "holdout",
    "contaminated": "contaminated",
    "duplicates_normalized": "dup normalized",
    "empty": "empty",
    "truncated": "truncated",
    "non_text": "non-text",
    "refusal": "refusal",
    "near_holdout": "near holdout",
    "near_duplicate": "near dup",
    "over_quota": "over quota",
    "kept": "kept",
}
_EXAMPLES_PER_REASON = 3
_NUMBER = re.compile(r"(?<![A-Za-z_-])\d+")


def empty_counts() -> dict[str, int]:
    return dict.fromkeys(COUNT_KEYS, 0)


def sum_counts(rows: Iterable[Mapping[str, int]]) -> dict[str, int]:
    total = empty_counts()
    for row in rows:
        for key in COUNT_KEYS:
            total[key] += row[key]
    return total


def funnel_counts(
    domains_of: Mapping[str, list[str]],
    rows_read: Mapping[str, int],
    outcomes: Iterable[tuple[str, str, str]],
) -> dict[str, dict[str, dict[str, int]]]:
    """source -> domain -> counts, from one (source, domain, outcome) per row.

    `domains_of` lists each source's possible domains (so a domain no row reached shows as
    zeros). A source whose records do not add up to the rows its reader counted is a bug in the
    stage, and stops it rather than report numbers that do not close.
    """
    counts = {s: {d: empty_counts() for d in ds} for s, ds in domains_of.items()}
    for source, domain, outcome in outcomes:
        row = counts[source].setdefault(domain, empty_counts())
        row[outcome] += 1
        row["rows_read"] += 1
    for source, by_domain in counts.items():
        recorded = sum(c["rows_read"] for c in by_domain.values())
        if recorded != rows_read[source]:
            raise RuntimeError(
                f"discovery lost track of rows: source {source!r} read {rows_read[source]} rows "
                f"but recorded {recorded}"
            )
    return counts


def reason_kinds(reasons: Iterable[str]) -> dict[str, int]:
    """Quarantine reasons with numbers (line, index, column) blanked, most common first.

    Digits glued to a letter stay: they are part of a name (ShareGPT_V3_..., utf-8)."""
    kinds = Counter(_NUMBER.sub("N", r) for r in reasons)
    return dict(sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))


def build_report(
    sources: Mapping[str, dict[str, Any]],
    counts: Mapping[str, Mapping[str, dict[str, int]]],
    mixture: Mapping[str, dict[str, Any]],
    settings: dict[str, Any],
    warnings: list[str],
    quarantine_reasons: dict[str, int],
    holdout_from: Mapping[str, Any] | None,
    synthesis: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """`sources`: name -> {kind, domain, path, formats, ...}; `counts`: see funnel_counts;
    `mixture`: domain -> {available, cap, kept}; `holdout_from`: where a pinned held-out set came
    from, with `carried_per_domain`, its rows held out as recorded there (no row read here);
    `synthesis`: with a synthesized source, the kept prompts per domain real beside synthesized
    (`kept_by_domain`) and the synthesis' summary."""
    by_domain: dict[str, list[dict[str, int]]] = {}
    for by_dom in counts.values():
        for domain, c in by_dom.items():
            by_domain.setdefault(domain, []).append(c)
    domains = {d: sum_counts(rows) for d, rows in sorted(by_domain.items())}
    per_source = {name: sum_counts(counts[name].values()) for name in sources}
    totals = sum_counts(per_source.values())
    carried = (holdout_from or {}).get("carried_per_domain", {})
    held_per_domain = {d: c["holdout"] + carried.get(d, 0) for d, c in domains.items()}
    return {
        "settings": settings,
        "sources": {name: {**info, **per_source[name]} for name, info in sources.items()},
        "domains": domains,
        "source_domains": {
            name: {d: dict(c) for d, c in sorted(counts[name].items())} for name in sources
        },
        "totals": totals,
        # The holdout table: the funnel's held-out rows and any carried from holdout_from.
        "holdout": {
            "per_domain": held_per_domain,
            "total": sum(held_per_domain.values()),
            "from": None if holdout_from is None else dict(holdout_from),
        },
        "mixture": {d: dict(m) for d, m in sorted(mixture.items())},
        "quarantine_reasons": dict(quarantine_reasons),
        "warnings": list(warnings),
        "synthesis": None if synthesis is None else dict(synthesis),
    }


def _cell(value: Any) -> str:
    text = "—" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return lines


def _counts_table(
    first: list[str], rows: Mapping[tuple[str, ...], Mapping[str, int]], totals: Mapping[str, int],
    keys: tuple[str, ...] = COUNT_KEYS,
) -> list[str]:
    headers = first + [_HEADERS[k] for k in keys]
    body = [[*names] + [c.get(k, 0) for k in keys] for names, c in rows.items()]
    body.append(["**total**"] + [""] * (len(first) - 1) + [f"**{totals.get(k, 0)}**" for k in keys])
    return _table(headers, body)


def _count_keys(report: Mapping[str, Any]) -> tuple[str, ...]:
    """The funnel's columns: the synthesized-only ones only when some source is synthesized."""
    if report.get("synthesis"):
        return COUNT_KEYS
    return tuple(k for k in COUNT_KEYS if k not in SYNTHESIZED_OUTCOMES)


def _synthesis_lines(report: Mapping[str, Any]) -> list[str]:
    """The kept prompts per domain, real beside synthesized, and what the synthesis cost."""
    synthesis = report.get("synthesis")
    if not synthesis:
        return []
    rows = []
    for domain, kept in synthesis["kept_by_domain"].items():
        total = kept["real"] + kept["synthesized"]
        share = f"{kept['synthesized'] / total:.0%}" if total else "—"
        rows.append([domain, kept["real"], kept["synthesized"], share])
    lines = ["", "## Real and synthesized prompts kept, per domain", "",
             *_table(["domain", "real", "synthesized", "synthesized share"], rows)]  # fmt: skip
    summary = synthesis.get("summary") or {}
    if summary:
        lines += ["", f"Synthesis: {summary.get('requests', 0)} requests over {summary.get('shards_total', 0)} "
                  f"shard(s), {summary.get('completion_tokens', 0)} tokens written"
                  f"{_rate(summary)}; engine {summary.get('engine', '—')}."]  # fmt: skip
    return lines


def _rate(summary: Mapping[str, Any]) -> str:
    rate = summary.get("tokens_per_s")
    return "" if rate is None else f" at {rate:,.0f} tokens/s (this process's own requests)"


def _row(record: Mapping[str, Any]) -> str:
    turn = record.get("user_turn")
    return f"{record['row_index']}" if turn is None else f"{record['row_index']} turn {turn}"


def _turn_rows(sources: Iterable[Mapping[str, Any]], rows_read: int) -> str:
    """What the count of rows read means when some source gave a prompt per user turn."""
    source_rows = sum(s["source_rows"] for s in sources)
    if source_rows == rows_read:
        return ""
    return f" (prompts and quarantined rows from {source_rows} rows: prompt_turns every_user)"


def _length_by_domain(settings: dict[str, Any]) -> str:
    """The domains with a length cap of their own (reports before the key have none)."""
    caps = settings.get("max_prompt_tokens_by_domain") or {}
    return "".join(f", {d} up to {n}" for d, n in sorted(caps.items()))


def _holdout_setting(report: Mapping[str, Any]) -> str:
    holdout = report["holdout"]
    if holdout["from"] is None:
        return f"{report['settings']['holdout_per_domain']} held out per domain"
    per_domain = ", ".join(f"{d} {n}" for d, n in holdout["per_domain"].items())
    carried = sum(holdout["from"]["carried_per_domain"].values())
    return (
        f"held-out set from holdout_from {holdout['from']['path']} ({per_domain}; {carried} of "
        f"them not among this run's candidates, held out as recorded there; "
        f"holdout_per_domain unused)"
    )


def filtered_examples(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The first few filtered rows of each reason, in the funnel's order."""
    picked: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        bucket = picked.setdefault(row["reason"], [])
        if len(bucket) < _EXAMPLES_PER_REASON:
            bucket.append(row)
    return [r for reason in FILTERED_OUTCOMES for r in picked.get(reason, [])]


def render_markdown(
    report: Mapping[str, Any],
    quarantine_examples: list[dict[str, Any]],
    filtered_examples: list[Mapping[str, Any]] = (),
) -> str:
    totals = report["totals"]
    settings = report["settings"]
    filtered = sum(totals.get(k, 0) for k in FILTERED_OUTCOMES)
    keys = _count_keys(report)
    lines = [
        "# Prompt discovery",
        "",
        f"**{totals['kept']}** prompts kept in the manifest over {len(report['domains'])} "
        f"domain(s); **{report['holdout']['total']}** held out for the gate; "
        f"**{totals['malformed']}** rows quarantined; {filtered} filtered; "
        f"{totals['rows_read']} rows read from {len(report['sources'])} source(s)"
        f"{_turn_rows(report['sources'].values(), totals['rows_read'])}.",
        "",
        f"Seed {settings['seed']}; prompt length {settings['min_prompt_tokens']}–"
        f"{settings['max_prompt_tokens']} tokens{_length_by_domain(settings)}; "
        f"{_holdout_setting(report)}; dedupe key: "
        f"{settings['dedupe_key']}; mixture mode: {settings['mixture_mode']}.",
        "",
        "## Per domain",
        "",
        *_counts_table(["domain"], {(d,): c for d, c in report["domains"].items()}, totals, keys),
        "",
        "## Per source",
        "",
        *_counts_table(["source"], {(n,): s for n, s in report["sources"].items()}, totals, keys),
    ]
    split = {
        (name, domain): c
        for name, by_domain in report["source_domains"].items()
        for domain, c in by_domain.items()
    }
    if len(split) > len(report["sources"]):  # some source spreads over several domains
        lines += ["", "## Per source and domain", ""]
        lines += _counts_table(["source", "domain"], split, totals, keys)
    lines += [
        "",
        "## Mixture",
        "",
        *_table(
            ["domain", "available", "cap", "kept"],
            [[d, m["available"], m["cap"], m["kept"]] for d, m in report["mixture"].items()],
        ),
        *_synthesis_lines(report),
    ]
    if report["warnings"]:
        lines += ["", "## Warnings", ""] + [f"- {w}" for w in report["warnings"]]
    if report["quarantine_reasons"]:
        lines += ["", "## Quarantine reasons", ""]
        lines += _table(
            ["reason", "rows"], [[r, n] for r, n in report["quarantine_reasons"].items()]
        )
    if quarantine_examples:
        lines += [
            "",
            f"## Quarantine (first {len(quarantine_examples)} of {totals['malformed']})",
            "",
            *_table(
                ["source", "row", "reason"],
                [[q["source"], _row(q), q["reason"]] for q in quarantine_examples],
            ),
        ]
    if filtered_examples:
        lines += [
            "",
            f"## Filtered (examples of each reason; all {filtered} in prompts/filtered.parquet)",
            "",
            *_table(
                ["source", "row", "reason", "detail"],
                [[f["source"], _row(f), f["reason"], f["detail"]] for f in filtered_examples],
            ),
        ]
    return "\n".join(lines) + "\n"
