"""The discovery funnel: where every row read went, per source, per domain and in total.

Each row read lands in exactly one bucket, in the order the stage applies them, so for every
source `rows_read` equals the sum of the other counts:
malformed -> duplicates_exact -> too_short / too_long -> holdout -> contaminated
-> duplicates_normalized -> over_quota -> kept.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

OUTCOMES = (
    "malformed",
    "duplicates_exact",
    "too_short",
    "too_long",
    "holdout",
    "contaminated",
    "duplicates_normalized",
    "over_quota",
    "kept",
)
COUNT_KEYS = ("rows_read", *OUTCOMES)

_HEADERS = {
    "rows_read": "read",
    "malformed": "malformed",
    "duplicates_exact": "dup exact",
    "too_short": "too short",
    "too_long": "too long",
    "holdout": "holdout",
    "contaminated": "contaminated",
    "duplicates_normalized": "dup normalized",
    "over_quota": "over quota",
    "kept": "kept",
}


def empty_counts() -> dict[str, int]:
    return dict.fromkeys(COUNT_KEYS, 0)


def sum_counts(rows: Iterable[Mapping[str, int]]) -> dict[str, int]:
    total = empty_counts()
    for row in rows:
        for key in COUNT_KEYS:
            total[key] += row[key]
    return total


def reason_kinds(reasons: Iterable[str]) -> dict[str, int]:
    """Quarantine reasons with numbers (line, index, column) blanked, most common first."""
    kinds = Counter(re.sub(r"\d+", "N", r) for r in reasons)
    return dict(sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))


def build_report(
    sources: Mapping[str, dict[str, Any]],
    source_counts: Mapping[str, dict[str, int]],
    mixture: Mapping[str, dict[str, Any]],
    settings: dict[str, Any],
    warnings: list[str],
    quarantine_reasons: dict[str, int],
) -> dict[str, Any]:
    """`sources`: name -> {domain, path, formats}; `mixture`: domain -> {available, cap, kept}."""
    by_domain: dict[str, list[dict[str, int]]] = {}
    for name, info in sources.items():
        by_domain.setdefault(info["domain"], []).append(source_counts[name])
    domains = {d: sum_counts(rows) for d, rows in sorted(by_domain.items())}
    totals = sum_counts(source_counts.values())
    return {
        "settings": settings,
        "sources": {name: {**info, **source_counts[name]} for name, info in sources.items()},
        "domains": domains,
        "totals": totals,
        "holdout": {
            "per_domain": {d: c["holdout"] for d, c in domains.items()},
            "total": totals["holdout"],
        },
        "mixture": {d: dict(m) for d, m in sorted(mixture.items())},
        "quarantine_reasons": dict(quarantine_reasons),
        "warnings": list(warnings),
    }


def _cell(value: Any) -> str:
    text = "—" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return lines


def _counts_table(
    first: str, rows: Mapping[str, Mapping[str, int]], totals: Mapping[str, int]
) -> list[str]:
    headers = [first] + [_HEADERS[k] for k in COUNT_KEYS]
    body = [[name] + [c[k] for k in COUNT_KEYS] for name, c in rows.items()]
    body.append(["**total**"] + [f"**{totals[k]}**" for k in COUNT_KEYS])
    return _table(headers, body)


def render_markdown(report: Mapping[str, Any], quarantine_examples: list[dict[str, Any]]) -> str:
    totals = report["totals"]
    settings = report["settings"]
    lines = [
        "# Prompt discovery",
        "",
        f"**{totals['kept']}** prompts kept in the manifest over {len(report['domains'])} "
        f"domain(s); **{totals['holdout']}** held out for the gate; "
        f"**{totals['malformed']}** rows quarantined; {totals['rows_read']} rows read "
        f"from {len(report['sources'])} source(s).",
        "",
        f"Seed {settings['seed']}; prompt length {settings['min_prompt_tokens']}–"
        f"{settings['max_prompt_tokens']} tokens; {settings['holdout_per_domain']} held out "
        f"per domain; mixture mode: {settings['mixture_mode']}.",
        "",
        "## Per domain",
        "",
        *_counts_table("domain", report["domains"], totals),
        "",
        "## Per source",
        "",
        *_counts_table("source", {n: s for n, s in report["sources"].items()}, totals),
        "",
        "## Mixture",
        "",
        *_table(
            ["domain", "available", "cap", "kept"],
            [[d, m["available"], m["cap"], m["kept"]] for d, m in report["mixture"].items()],
        ),
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
                [[q["source"], q["row_index"], q["reason"]] for q in quarantine_examples],
            ),
        ]
    return "\n".join(lines) + "\n"
