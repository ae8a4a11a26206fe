"""What each stage's summary says to a person: a one-line headline and a few fields, for the
stage's Slack messages (flows/common.py). The summaries themselves (the stages' return values,
their markers) stay as the stages write them; this only chooses and words their figures, through
tasks/humanize.py. A stage or a summary this does not know is shown whole, each field readable.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import tasks.humanize as h

Story = tuple[str, dict[str, str]]  # (headline, {label: readable value})
# discover's totals that are not prompts left out: what it read, kept and held out.
DISCOVER_KEPT = ("rows_read", "kept", "holdout")


def _nonzero(mapping: Mapping[str, Any], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    return {k: v for k, v in mapping.items() if k not in skip and isinstance(v, int | float) and v}


def discover_story(s: Mapping[str, Any]) -> Story:
    kept, read, held = s["kept"], s["rows_read"], s.get("holdout")
    headline = f"{h.number(kept)} prompts kept of {h.number(read)} read, {h.number(held)} held out"
    left_out = _nonzero(s, DISCOVER_KEPT)
    return headline, {"prompts kept": h.number(kept), "rows read": h.number(read), "held out": h.number(held),
                      "left out": h.counts({h.label(k): v for k, v in left_out.items()})}  # fmt: skip


def _dead(total: Any, classes: Mapping[str, Any] | None) -> str:
    return h.number(total) + (f" ({h.counts(classes)})" if classes else "")


def generate_story(s: Mapping[str, Any]) -> Story:
    shards = f"{h.number(s['shards_committed'])} / {h.number(s.get('shards_total'))}"
    headline = (f"{h.number(s['rows'])} rows in {shards} shards, {h.number(s.get('completion_tokens'))} tokens, "
                f"{h.number(s.get('dead'))} dead letters")  # fmt: skip
    fields = {
        "rows": h.number(s.get("rows")),
        "shards": shards,
        "dead letters": _dead(s.get("dead"), s.get("dead_classes")),
        "prompt tokens": h.number(s.get("prompt_tokens")),
        "completion tokens": h.number(s.get("completion_tokens")),
        "hit max_new_tokens": h.percent(s.get("finish_length_rate")),
        "requests sent per request": h.number(s.get("sent_per_request")),
    }
    # The quality flags, where there is one to flag.
    fields.update({h.label(k): h.number(s[k]) for k in ("empty_outputs", "unterminated_think") if s.get(k)})
    if s.get("reused"):
        fields["reused"] = f"{h.number(s['reused'])} from {s.get('reused_from')}"
    return headline, fields


def extract_story(s: Mapping[str, Any]) -> Story:
    shards = f"{h.number(s.get('shards_extracted'))} / {h.number(s.get('shards_generated'))}"
    headline = (f"{h.number(s['sequences'])} sequences, {h.number(s.get('tokens'))} tokens, "
                f"{h.size(s.get('bytes'))} in {shards} shards")  # fmt: skip
    fields = {
        "sequences": h.number(s.get("sequences")),
        "shards": shards,
        "tokens": h.number(s.get("tokens")),
        "loss tokens": h.number(s.get("loss_tokens")),
        "stored": f"{h.size(s.get('bytes'))} ({s.get('storage_dtype')})",
        "splits": h.counts(s.get("splits")),
        "max relative RMS error": h.counts(s.get("max_rel_rms_error")),
    }
    fields.update({h.label(k): h.number(v) for k, v in _nonzero(s).items() if k in ("truncated", "dead")})
    return headline, fields


def train_story(s: Mapping[str, Any]) -> Story:
    accept = h.number(s.get("best_sim_accept_len"), 3)
    headline = f"{h.number(s.get('steps'))} steps; best step {h.number(s['best_step'])}, simulated accept length {accept}"
    fields = {"steps": h.number(s.get("steps")), "best step": h.number(s.get("best_step")),
              "simulated accept length": accept, "exported to": str(s.get("final") or h.DASH)}  # fmt: skip
    if s.get("scaling_drafts"):
        fields["scaling drafts"] = h.value(s["scaling_drafts"]) + " sequences"
    return headline, fields


def gate_story(s: Mapping[str, Any]) -> Story:
    """The gate's own summary (its decision message is flows/gate.py's)."""
    ci = s.get("ci") or [None, None]
    headline = f"{str(s['outcome']).upper()}: speedup {h.speedup(s.get('speedup'), *ci)}"
    return headline, {"decision": str(s.get("outcome")), "speedup": h.speedup(s.get("speedup"), *ci)}


STORIES: dict[str, Callable[[Mapping[str, Any]], Story]] = {
    "discover": discover_story, "generate": generate_story, "extract": extract_story,
    "train": train_story, "gate": gate_story,
}  # fmt: skip


def completed(stage: str, summary: Mapping[str, Any]) -> Story:
    """(headline, fields) of a stage that completed with this summary."""
    teller = STORIES.get(stage)
    if teller is not None:
        try:
            return teller(summary)
        except (TypeError, ValueError, KeyError):  # a summary without its key figures: shown whole below
            pass
    return "", h.fields(summary, drop=("skipped",))


def started(stage: str, details: Mapping[str, Any]) -> Story:
    """(headline, fields) of a stage's start. Extraction's disk forecast is one sentence of its
    own (its summary) rather than its dozen byte counts."""
    details = dict(details)
    if stage == "extract" and "summary" in details:
        headline = f"{h.number(details.get('shards_to_run'))} shards to run; forecast {details['summary']}"
        keep = ("shards_to_run", "following_generation", "fits")
        fields = h.fields({k: details[k] for k in keep if k in details})
        return headline, {**fields, "forecast": str(details["summary"])}
    # A start has a few settings: they are the headline, with no fields under it.
    return ", ".join(f"{k}: {v}" for k, v in h.fields(details).items()), {}
