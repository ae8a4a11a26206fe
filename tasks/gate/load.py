"""The gate at load (docs/GATE.md): each config's figures per concurrency level, its speedup over
the baseline at the same level with the bootstrap CI, and where it stops paying.

A level's figures come from its own requests: per-request tok/s (output tokens over the request's
latency, queueing included), the pooled rate (the level's output tokens over the sum of its
latencies), the level's throughput (output tokens over its wall time, per launch), latency and
time per output token. The speedup at concurrency 1 is the ratio of the median per-request tok/s,
as the gate always measured it. Above it, the speedup is the ratio of the pooled rates: with the
same number of requests in flight on both sides it is the ratio of the throughputs (C requests
always in flight: wall time = summed latency / C), where the median would read the requests that
ran and miss the ones that queued behind a running-request cap (SGLang 0.5.14's 48 on a
speculative server at concurrency 64: the median 1.26x, the throughput 0.94x, on the H200,
BENCHMARKS P32). Both are bootstrapped alike: request slots paired, launches resampled.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from tasks.gate.plan import POLICY
from tasks.gate.records import BenchResult, RequestRecord, pooled_accept_lengths


@dataclass
class LevelSummary:
    """One config at one concurrency level."""

    level: int
    n_requests: int = 0
    n_errors: int = 0
    median_tok_s: float | None = None  # per request
    pooled_tok_s: float | None = None  # output tokens over latency, summed over the level's requests
    throughput_tok_s: float | None = None  # output tokens over the level's wall time, median over launches
    latency_p50_s: float | None = None
    latency_p90_s: float | None = None
    tpot_p50_ms: float | None = None  # a request's latency over its output tokens
    accept_length: float | None = None
    max_running_requests: int | None = None  # the cap its server reported (None: not reported)
    speedup: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None

    def wins(self) -> bool:
        """Faster than the baseline beyond the spread (the CI above 1)."""
        return self.ci_low is not None and self.ci_low > 1.0

    def loses(self) -> bool:
        """Slower than the baseline beyond the spread (the CI below 1)."""
        return self.ci_high is not None and self.ci_high < 1.0


def tok_s_matrix(records: list[RequestRecord], columns: int) -> np.ndarray:
    """[launch, request slot] of per-request tok/s; NaN where a request failed or is missing."""
    reps = sorted({r.repetition for r in records})
    m = np.full((len(reps), columns), np.nan)
    row = {rep: i for i, rep in enumerate(reps)}
    for r in records:
        if r.error is None and r.tok_s is not None and r.column < columns:
            m[row[r.repetition], r.column] = r.tok_s
    return m


def rate_matrices(records: list[RequestRecord], columns: int) -> tuple[np.ndarray, np.ndarray]:
    """[launch, request slot] of output tokens and of latency seconds; NaN where a request failed
    or is missing: what the pooled rate at a load level is bootstrapped from."""
    reps = sorted({r.repetition for r in records})
    tokens, latency = np.full((len(reps), columns), np.nan), np.full((len(reps), columns), np.nan)
    row = {rep: i for i, rep in enumerate(reps)}
    for r in records:
        if r.error is None and r.latency_s > 0 and r.column < columns:
            tokens[row[r.repetition], r.column] = r.completion_tokens
            latency[row[r.repetition], r.column] = r.latency_s
    return tokens, latency


def _quantile(values: list[float], q: float) -> float | None:
    return float(np.quantile(values, q)) if values else None


def level_summary(result: BenchResult, config: str, level: int) -> LevelSummary:
    """`config`'s own figures at `level` (the speedup is set against a baseline by the decision)."""
    records = result.records(config, level)
    s = LevelSummary(level, len(records), sum(r.error is not None for r in records))
    ok = [r for r in records if r.error is None]
    m = tok_s_matrix(records, result.columns(level))
    if m.size and not np.all(np.isnan(m)):
        s.median_tok_s = float(np.nanmedian(m))
    launches = [x for x in result.launches if x.config == config and str(level) in x.levels]
    rates = [x.levels[str(level)]["tok_s"] for x in launches if x.levels[str(level)].get("tok_s")]
    s.throughput_tok_s = statistics.median(rates) if rates else None
    if ok and sum(r.latency_s for r in ok) > 0:
        s.pooled_tok_s = sum(r.completion_tokens for r in ok) / sum(r.latency_s for r in ok)
    s.latency_p50_s, s.latency_p90_s = _quantile([r.latency_s for r in ok], 0.5), _quantile([r.latency_s for r in ok], 0.9)
    per_token = [1e3 * r.latency_s / r.completion_tokens for r in ok if r.completion_tokens]
    s.tpot_p50_ms = _quantile(per_token, 0.5)
    s.accept_length = pooled_accept_lengths(records)[0]
    caps = {x.max_running_requests for x in launches if x.max_running_requests is not None}
    s.max_running_requests = min(caps) if caps else None
    return s


def measured_levels(result: BenchResult, config: str) -> list[int]:
    return sorted({r.concurrency for r in result.records(config)})


def crossover(levels: dict[int, LevelSummary]) -> dict[str, Any]:
    """Where a config stops paying: `pays_up_to`, the highest level up to which it wins beyond the
    spread at every level from the lowest (None: not even there); `crossover`, the concurrency
    where its point speedup first falls below 1, interpolated between the two levels around it on
    a log2 scale (None when it never falls below 1, or is below 1 from the lowest level);
    `wins_at` and `loses_at`, the levels beyond the spread either way."""
    ordered = [levels[c] for c in sorted(levels) if levels[c].speedup is not None]
    pays_up_to = None
    for s in ordered:
        if not s.wins():
            break
        pays_up_to = s.level
    cross = None
    for lo, hi in zip(ordered, ordered[1:], strict=False):
        assert lo.speedup is not None and hi.speedup is not None
        if lo.speedup >= 1.0 > hi.speedup:
            t = (lo.speedup - 1.0) / (lo.speedup - hi.speedup)
            cross = 2 ** (math.log2(lo.level) + t * (math.log2(hi.level) - math.log2(lo.level)))
            break
    return {
        "pays_up_to": pays_up_to,
        "crossover": cross,
        "below_from_lowest": bool(ordered) and ordered[0].speedup is not None and ordered[0].speedup < 1.0,
        "wins_at": [s.level for s in ordered if s.wins()],
        "loses_at": [s.level for s in ordered if s.loses()],
    }


def crossover_words(c: dict[str, Any]) -> str:
    """A crossover record in a phrase: where the config stops paying."""
    if c["below_from_lowest"]:
        return "slower from the lowest level"
    if c["crossover"] is None:
        return "pays at every measured level" if c["wins_at"] else "never beyond the spread"
    return f"stops paying at ~{c['crossover']:.0f} concurrent requests"


def _baselines(result: BenchResult) -> list[str]:
    """The plain launches' configs (the policy's own plain launch aside)."""
    return [c.name for c in result.configs if c.is_baseline and c.role != POLICY]


def _baseline_replies(result: BenchResult, level: int) -> list[int]:
    """The output tokens of the baseline's measured requests at `level`."""
    return [r.completion_tokens for name in _baselines(result) for r in result.records(name, level) if r.error is None]


def admission_share(result: BenchResult, level: int) -> float:
    """The share of the baseline's admissions at `level` that come alone (admission_events, on its
    first launch's replies in the order they were sent); 1.0 where none was measured."""
    baselines = _baselines(result)
    launch = next((x for x in result.launches if x.config in baselines), None)
    sent = [] if launch is None else [r for r in launch.requests if r.concurrency == level and r.error is None]
    return admission_events([r.completion_tokens for r in sorted(sent, key=lambda r: r.column)], level) if sent else 1.0


def admission_events(lengths: list[int], level: int) -> float:
    """Of the admissions a closed loop of `level` makes over requests of these reply lengths (in
    the order sent; one token a step, each end admitting the next request at the next step), the
    share that are events of their own: ends that coincide admit their successors together, in one
    prefill that stalls the batch once (SGLang prefills arrivals that coincide as one batch; so
    does the emulator). 1.0 where every admission comes alone (lengths all different and never
    ending together), less where replies end together (15 of run 28's 32 at the 256 cap:
    BENCHMARKS P36); 1.0 when nothing is admitted after the first batch."""
    running, pending = list(lengths[:level]), list(lengths[level:])
    admitted = events = 0
    while running:
        running = [n - 1 for n in running]
        ended = sum(n <= 0 for n in running)
        running = [n for n in running if n > 0]
        if ended and pending:
            take, pending = pending[:ended], pending[ended:]
            running += take
            admitted, events = admitted + len(take), events + 1
    return events / admitted if admitted else 1.0


def reply_tokens(result: BenchResult, level: int) -> float | None:
    """The mean output tokens of the baseline's measured requests at `level`: the requests the
    measured rate is for (real replies end at their own lengths, a rehearsal's at max_new_tokens
    or gate.simulated_reply_tokens)."""
    tokens = _baseline_replies(result, level)
    return statistics.mean(tokens) if tokens else None


def ends_one_at_a_time(result: BenchResult, level: int) -> bool:
    """Whether the baseline's requests at `level` end at lengths of their own (real replies, a
    rehearsal's simulated_reply_tokens), so that they are admitted one at a time; not when every
    one runs to the same length and a level's requests end, and are admitted, together."""
    return len(set(_baseline_replies(result, level))) > 1


def predict_levels(result: BenchResult, accept_lengths: dict[int, float], tokens: float | None) -> dict[str, Any]:
    """Per level: the step costs its probes timed and the per-request tok/s they predict for the
    baseline and each num_steps (the replay's accept lengths, as at concurrency 1) at the level's
    own reply length (reply_tokens; `tokens` where none was measured), beside the measured rate
    (the median at concurrency 1, the pooled rate above). Above a server's running-request cap a
    request queues for a slot: its step is the probe's first turn's, stretched by level / cap
    (cost_model.queued_step). Where replies end one at a time and the launches ran the admission
    probe, a request is prefilled alone (the lowest level's prefill) and stalled by the admissions
    of level - 1 others at its config's admit_s each, as many of them as come alone
    (admission_share: ends that coincide are admitted in one prefill)."""
    from tasks.gate.cost_model import CostModelError, costs_from_launches, predict

    levels = sorted({r.concurrency for x in result.launches for r in x.requests})
    configs = {c.name: c for c in result.configs}
    out: dict[str, Any] = {}
    lone_prefill: float | None = None  # the lowest level's prefill, read once a level needs it
    for level in levels:
        try:
            costs = costs_from_launches(result, level=level)
            admissions, share = 0.0, None
            if costs.admit_s and ends_one_at_a_time(result, level):  # each a lone prefill, stalling the rest
                if lone_prefill is None:
                    lone_prefill = costs_from_launches(result, level=levels[0]).prefill_s
                share = admission_share(result, level)
                costs, admissions = replace(costs, prefill_s=lone_prefill), (level - 1.0) * share
            lengths = {k: v for k, v in accept_lengths.items() if costs.covers(k)}
            prediction = predict(costs, lengths, reply_tokens(result, level) or tokens, admissions) if lengths else None
        except CostModelError as e:
            out[str(level)] = {"error": str(e)}
            continue
        predicted = prediction.gate_predictions() if prediction else {"baseline": None}
        rows = {}
        for name, tok_s in predicted.items():
            summary = level_summary(result, name, level) if name in configs else None
            # The rate the speedup is taken on: the median at concurrency 1, the pooled rate above.
            measured = None if summary is None else summary.median_tok_s if level <= 1 else summary.pooled_tok_s
            rows[name] = {"predicted_tok_s": tok_s, "measured_tok_s": measured,
                          "error": tok_s / measured - 1 if tok_s and measured else None}  # fmt: skip
        out[str(level)] = {"costs": costs.to_dict(), "admission_share": share, "configs": rows}
    return out


def load_record(result: BenchResult, summaries: list[Any], accept_lengths: dict[int, float],
                tokens: float | None, deploy_level: int) -> dict[str, Any]:  # fmt: skip
    """gate/load.json: the levels, each config's figures per level and where it stops paying
    (`summaries`: the decision's ConfigSummary list), and the per-level prediction."""
    levels = sorted({r.concurrency for x in result.launches for r in x.requests})
    return {
        "concurrency": levels,
        "deploy_concurrency": deploy_level,
        "configs": {s.name: {"role": s.role, "baseline": s.baseline, "crossover": s.crossover,
                             "levels": {k: asdict(v) for k, v in s.levels.items()}}
                    for s in summaries if s.levels},  # fmt: skip
        "prediction": predict_levels(result, accept_lengths, tokens),
    }
