"""gate/report.json, gate/report.md and gate/plots/*.png: every decision with its numbers."""

from __future__ import annotations

import io
import json
import time
from typing import Any

import tasks.humanize as h
from tasks.config.gate_section import GateConfig
from tasks.gate.breakeven import breakeven_markdown
from tasks.gate.decision import ConfigSummary, GateDecision
from tasks.gate.gpu_samples import window_summary
from tasks.gate.plan import CANDIDATE
from tasks.gate.records import BenchResult
from tasks.redaction import redact_secret_keys
from tasks.runfolder import RunFolder

REPORT_JSON = "gate/report.json"
REPORT_MD = "gate/report.md"
PLOTS = "gate/plots"
def _num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def verdict(decision: GateDecision, name: str | None, role: str, eligible: bool, reasons: list[str]) -> str:
    """A config's verdict in words that cannot be read against the decision: an eligible
    config beside a REJECT is the best one not promoted, or one that only passed the checks."""
    if not eligible:
        return "; ".join(reasons) or "not eligible"
    if role != CANDIDATE:  # measured beside the new draft: never promoted by this gate
        return "passes the checks (not a candidate)"
    if name == decision.best:
        return "promoted" if decision.promote else f"best, not promoted ({decision.outcome})"
    return "passes the checks, not the best"


def _ci(s: ConfigSummary) -> str:
    """`1.76x [0.885, 2.54]`, as every figure people read (tasks/humanize.py); report.json keeps the digits."""
    return "-" if s.speedup is None else h.speedup(s.speedup, s.ci_low, s.ci_high)


def _margin(m: list[float] | None) -> str:
    return "-" if m is None else h.speedup(m[0], m[1], m[2])


def contenders_markdown(decision: GateDecision, cfg: GateConfig) -> list[str]:
    """Every draft at its best config side by side, the baseline first; the incumbent and the
    contenders left out, with why."""
    if not decision.contenders and not decision.left_out and not decision.incumbent:
        return []
    lines = ["## Contenders", ""]
    inc = decision.incumbent
    if inc:
        # num_steps_from: "evidence", "sweep" or "sweep (why not the evidence)"
        source = ("at its promotion's best config" if inc["num_steps_from"] == "evidence"
                  else "over the gate's sweep" + inc["num_steps_from"].removeprefix("sweep"))  # fmt: skip
        lines.append(f"Incumbent: `{inc['draft_id']}` ({inc['uri']}), measured {source}.")
        if inc.get("not_measured"):
            lines.append(f"It gave no valid measurement ({inc['not_measured']}): the new draft was judged against the baseline alone.")
        elif inc.get("margin") is not None:
            beyond = "beyond" if inc["beaten"] else "not beyond"
            lines.append(f"The new draft's margin over it: {_margin([inc['margin'], *inc['ci']])} ({cfg.ci_level:.0%} CI), {beyond} the spread.")
        lines.append("")
    lines.append(f"| contender | best config | median tok/s | speedup ({cfg.ci_level:.0%} CI) | accept len | acceptance per position | exact match | vs incumbent ({cfg.ci_level:.0%} CI) | verdict |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    base = decision.config(decision.baseline)
    if base is not None:
        lines.append(f"| baseline | {base.name} | {_num(base.median_tok_s)} | 1.000x | - | - | - | - | reference |")
    for c in decision.contenders:
        pos = ", ".join(f"{p:.2f}" for p in c.accept_per_position or []) or "-"
        speed = "-" if c.speedup is None else h.speedup(c.speedup, c.ci_low, c.ci_high)
        exact = "-" if c.exact_match_fraction is None else f"{c.exact_match_fraction:.0%}"
        says = verdict(decision, c.config, c.role, c.eligible, c.reasons)
        lines.append(f"| {c.name} ({c.role}) | {c.config or '-'} | {_num(c.median_tok_s)} | {speed} | "
                     f"{_num(c.accept_length, '.2f')} | {pos} | {exact} | {_margin(c.vs_incumbent)} | {says} |")  # fmt: skip
    if decision.left_out:
        lines += ["", "Left out (not benchmarked):", ""]
        lines += [f"- {x['name']} ({x['role']}): {x['reason']}" for x in decision.left_out]
    return lines + [""]


def _level_cell(lv: Any) -> str:
    if lv is None or lv.speedup is None:
        return "-"
    mark = " **+**" if lv.wins() else (" **-**" if lv.loses() else "")
    return f"{lv.speedup:.2f}x [{_num(lv.ci_low, '.2f')}, {_num(lv.ci_high, '.2f')}]{mark}"


def load_markdown(decision: GateDecision, cfg: GateConfig) -> list[str]:
    """Per concurrency level: each config's speedup over the baseline with its CI (+ faster, -
    slower, beyond the spread), the baseline's tok/s and where each config stops paying."""
    if len(cfg.concurrency) <= 1:
        return []
    from tasks.gate.load import crossover_words

    levels = [str(c) for c in cfg.concurrency]
    base = decision.config(decision.baseline)
    lines = ["", "## At load", "",
             f"Speedup over the baseline at the same concurrency ({cfg.ci_level:.0%} CI; **+** faster, **-** slower, "
             "beyond the spread), from each request's tok/s (output tokens over its latency, queueing included).", "",
             "| config | " + " | ".join(f"c={c}" for c in levels) + " | where it stops paying |",
             "|---|" + "---|" * (len(levels) + 1)]  # fmt: skip
    if base is not None:
        tput = [_num(base.levels[c].throughput_tok_s, ",.0f") if c in base.levels else "-" for c in levels]
        lines.append("| baseline (output tok/s over the wall time) | " + " | ".join(tput) + " | - |")
    for s in decision.configs:
        if s.baseline or len(s.levels) <= 1:
            continue
        words = crossover_words(s.crossover) if s.crossover else "-"
        lines.append(f"| {s.name} | " + " | ".join(_level_cell(s.levels.get(c)) for c in levels) + f" | {words} |")
    caps = sorted({(s.name, lv.max_running_requests) for s in decision.configs for lv in s.levels.values()
                   if lv.max_running_requests is not None and lv.max_running_requests < max(cfg.concurrency)})  # fmt: skip
    if caps:
        lines += ["", "Running-request caps below the highest level (the rest of a level's requests queued): "
                  + ", ".join(f"{n} {c}" for n, c in caps) + "."]  # fmt: skip
    return lines


def load_prediction_markdown(load: dict[str, Any] | None) -> str:
    """gate/load.json's prediction: per level, each config's per-request tok/s predicted from
    that level's cost probes and the replay's accept length, beside the measured median."""
    if not load or not load.get("prediction"):
        return ""
    levels = sorted(load["prediction"], key=int)
    names = list(dict.fromkeys(n for lv in levels for n in load["prediction"][lv].get("configs", {})))
    lines = ["", "## Predicted per level", "",
             "Per-request tok/s predicted from each level's cost probes and the replay's accept length / measured "
             "(the error).", "", "| config | " + " | ".join(f"c={c}" for c in levels) + " |",
             "|---|" + "---|" * len(levels)]  # fmt: skip
    for name in names:
        cells = []
        for lv in levels:
            r = load["prediction"][lv].get("configs", {}).get(name)
            if not r or r.get("predicted_tok_s") is None:
                cells.append("-")
                continue
            err = f" ({r['error']:+.1%})" if r.get("error") is not None else ""
            cells.append(f"{r['predicted_tok_s']:.0f} / {_num(r.get('measured_tok_s'), '.0f')}{err}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    shares = [load["prediction"][lv].get("admission_share") for lv in levels]
    if any(x is not None for x in shares):  # replies that end at their own lengths: admissions counted per prefill
        lines.append("| admissions that come alone | " + " | ".join(_num(x, ".2f") for x in shares) + " |")
    return "\n".join(lines) + "\n"


def policy_markdown(policy: dict[str, Any] | None, cfg: GateConfig) -> list[str]:
    """The serving policy: what runs at each level, its files and flags, and its own launch."""
    if not policy:
        return []
    holds = {True: "holds", False: "does not hold", None: "not judged"}[policy["holds"]]
    lines = ["", "## Serving policy", "", f"Kind: **{policy['kind']}**; {holds}.", ""]
    lines += [f"- {r}" for r in policy["reasons"]]
    lines += ["", "| concurrency | num_steps | config | sweep speedup | own launch | vs the sweep |", "|---|---|---|---|---|---|"]
    verified = policy.get("verified") or {}
    for c in policy["levels"]:
        v = verified.get(str(c["level"]))
        own = f"{v['speedup']:.3f}x [{_num(v['ci'][0], '.3f')}, {_num(v['ci'][1], '.3f')}]" if v else "-"
        gap = f"{v['vs_predicted']:+.1%}" if v and v.get("vs_predicted") is not None else "-"
        sweep = f"{c['speedup']:.3f}x" if c.get("speedup") is not None else "- (plain)"
        lines.append(f"| {c['level']} | {c['num_steps']} | {c['config'] or '-'} | {sweep} | {own} | {gap} |")
    if policy.get("adaptive_config"):
        lines += ["", "SGLang (`gate/sglang-adaptive.json`, launch flags `" + " ".join(
            ["--speculative-num-steps", str(policy["num_steps"]), "--speculative-eagle-topk 1",
             "--speculative-adaptive --speculative-adaptive-config sglang-adaptive.json",
             f"--max-running-requests {policy['max_running_requests']}"]) + "`):", "",
                  "```json", json.dumps(policy["adaptive_config"]), "```"]  # fmt: skip
    if policy.get("vllm"):
        lines += ["", f"vLLM speculative_config: `{json.dumps(policy['vllm'])}`"]
    return lines + [""]


def verify_sentence(div: dict[str, Any]) -> str:
    """What a divergence's verify view (tasks/gate/lossless.py verify_view) says, in words."""
    v = div["verify"]
    if "error" in v or "skipped" in v:
        return f"no view: {v.get('error') or v.get('skipped')}"
    if not v["reproduced"]:
        return f"sent again, it left the timed output at position {v['left_at']}: no view"
    bound = "at least " if v["own_gap_is_bound"] else ""
    drift = (f"the two paths differ by at most {v['prefix_drift_max']:.3f} nats (mean {v['prefix_drift_mean']:.3f}) on "
             f"the {v['positions']} tokens before it")  # fmt: skip
    if v["own_gap"] < 0:
        return (f"its own forward put token {div['speculative_token']} {-v['own_gap']:.3f} nats below token "
                f"{div['baseline_token']}, yet emitted it: a change of output, not numerics; {drift}")  # fmt: skip
    at = f", so the paths disagree there by {v['disagreement']:.3f}" if v.get("disagreement") is not None else ""
    return f"its own forward put token {div['speculative_token']} first by {bound}{v['own_gap']:.3f} nats{at}; {drift}"


def lossless_markdown(decision: GateDecision, result: BenchResult, cfg: GateConfig) -> list[str]:
    """The lossless rule's tally per config beside the baseline-vs-baseline one (the rate to
    expect), the first divergences, and what the re-scores showed."""
    rows = [s for s in decision.configs if s.lossless.get("compared")]
    if not rows:
        return []
    lines = ["", "## Lossless check", "",
             f"Each output equals the baseline's reference (its first launch) or first leaves it at a near-tie: the "
             f"two tokens both lie within {cfg.near_tie_nats:g} nats of the best there, by the baseline's "
             f"prefill re-score (top {cfg.top_logprobs_num})"
             + (f", frequency penalty {cfg.frequency_penalty:g} applied as decode applied it" if cfg.frequency_penalty else "")
             + ". Nothing after the first divergence is compared.", "",
             "| config | compared | exact | near-tie | not lossless | no evidence | first divergences (position, gap nats, class) |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in rows:
        n = s.lossless
        divs = [r.divergence for r in result.records(s.name) if r.divergence and not r.reference]
        shown = ", ".join(f"{d['position']} ({_num(d.get('gap'), '.2f')}, {d['cls'].replace('_', ' ')})" for d in divs[:6])
        name = f"{s.name} (vs its first launch)" if s.baseline else s.name
        lines.append(f"| {name} | {n['compared']} | {n['exact']} | {n['near_tie']} | {n['not_lossless']} | "
                     f"{n['no_evidence']} | {shown + (' ...' if len(divs) > 6 else '') or '-'} |")  # fmt: skip
    for s in decision.configs:
        if s.baseline and s.refusals:
            lines += ["", f"**Baseline-vs-baseline is not lossless ({s.name}): the threshold or the server is off.** "
                          f"First: {s.refusals[0]}"]  # fmt: skip
    viewed = [(s.name, r) for s in rows for r in result.records(s.name) if r.divergence and "verify" in r.divergence]
    if viewed:
        lines += ["", "The speculative server's own view (the request sent again, untimed, with return_logprob; "
                      "gate.verify_logprobs), never deciding a verdict:", ""]  # fmt: skip
        lines += [f"- {name} request {r.prompt_index} rep {r.repetition}, position {r.divergence['position']}: "
                  f"{verify_sentence(r.divergence)}" for name, r in viewed]  # fmt: skip
    rescored = [x for x in result.launches if x.rescore]
    if rescored:
        lines += ["", "Re-scores (per baseline launch): prompts, positions, positions whose decode token is not the "
                      "re-score's top one (decode and prefill split a near-tie), largest change of a reference "
                      "token's logprob from the first launch's re-score:", ""]  # fmt: skip
        for x in rescored:
            r = x.rescore
            errors = f"; {len(r['errors'])} failed: {r['errors'][0]}" if r["errors"] else ""
            lines.append(f"- {x.config} rep {x.repetition}: {r['prompts']} prompts, {r['positions']} positions, "
                         f"{r['argmax_flips']} argmax flips, max delta {_num(r['max_abs_delta_vs_first'], '.4f')}{errors}")  # fmt: skip
    return lines


def _launches_markdown(result: BenchResult, cfg: GateConfig) -> list[str]:
    """The server launches' table: start-up, graphs, probes, the GPU's clock, problems; their time."""
    lines = ["", "## Launches", "", "| config | rep | ready after s | of it, before the scheduler process's first line s | graph captures (target/draft/extend) | decode lines on graphs | time to 1st token ms | ms per step or cycle | SM clock MHz while measured (median, lowest) | problems |", "|---|---|---|---|---|---|---|---|---|---|"]
    for x in result.launches:
        caps = x.log.get("captures", {})
        cap = "/".join(str(caps.get(k, {}).get("end", 0)) for k in ("target", "draft", "draft_extend"))
        graphs = f"{x.log.get('decode_cuda_graph_true', 0)}/{x.log.get('decode_lines', 0)}"
        problems = "; ".join(x.info_problems + x.graph_problems + x.info_notes
                             + ([x.error.splitlines()[0]] if x.error else [])) or "-"  # fmt: skip
        ttft = _num(x.prefill_s * 1e3 if x.prefill_s else None, ".2f")
        step = _num(x.step_s * 1e3 if x.step_s else None, ".3f")
        # The start-up's processes (Python importing SGLang twice) against the model's load and graphs.
        processes = _num(x.log.get("startup_s", {}).get("scheduler"))
        gpu = window_summary(x.gpu_samples, x.measured_at or 0.0, x.ended_at or 0.0)
        clock = f"{gpu['sm_mhz_median']:.0f}, {gpu['sm_mhz_min']:.0f}" if gpu else "-"
        lines.append(f"| {x.config} | {x.repetition} | {_num(x.health_s)} | {processes} | {cap} | {graphs} | {ttft} | {step} | {clock} | {problems} |")
    timed = [x for x in result.launches if x.started_at is not None and x.ended_at is not None]
    if timed:
        held = sum((x.ended_at or 0.0) - (x.started_at or 0.0) for x in timed)
        ready = sum(x.health_s or 0.0 for x in timed)
        lines += ["", f"{len(result.launches)} launches; the servers up {held:,.0f} s in all (GPU time with "
                  f"concurrent_servers 1), {ready:,.0f} s of it starting."]  # fmt: skip
    if cfg.concurrent_servers > 1:
        lines += ["", f"Servers started in waves of {cfg.concurrent_servers}; each was measured alone "
                  "while the others of its wave waited idle."]  # fmt: skip
    return lines


def render_markdown(decision: GateDecision, result: BenchResult, cfg: GateConfig) -> str:
    lines = [f"# Gate decision: {decision.outcome.upper()}", ""]
    lines += [f"- {r}" for r in decision.reasons] + [""]
    if cfg.engine == "local":
        where = f"passes per config, the local speculative engine on {cfg.device} (decode tok/s)"
    else:
        where = f"fresh launches per config, SGLang {cfg.sglang_version} ({cfg.engine})"
    lines.append(
        f"Reference baseline: `{decision.baseline}`; best speculative config: `{decision.best}`; "
        f"{len(result.prompts)} held-out prompts x {cfg.repetitions} {where}, "
        + (f"concurrency {', '.join(map(str, cfg.concurrency))} (headline figures at {cfg.deploy_level})"
           if len(cfg.concurrency) > 1 else f"concurrency {cfg.concurrency[0]}")
        + ", temperature 0"
        + (f", frequency penalty {cfg.frequency_penalty:g}." if cfg.frequency_penalty else ".")
    )
    lines += ["", *contenders_markdown(decision, cfg), "## Configs", ""]
    lines.append(f"| config | env | median tok/s | repetition medians | spread | speedup ({cfg.ci_level:.0%} CI) | accept len | exact match | verdict |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for s in decision.configs:
        reps = ", ".join(f"{m:.1f}" for m in s.rep_medians) or "-"
        exact = "-" if s.exact_match_fraction is None else f"{s.exact_match_fraction:.0%} of {s.n_compared}"
        says = "reference" if s.baseline else verdict(decision, s.name, s.role, s.eligible, s.reasons)
        if s.role != CANDIDATE:  # measured beside the candidate, never promoted
            says = f"{s.role}{f' ({s.samples} samples)' if s.samples else ''}: {says}"
        lines.append(
            f"| {s.name} | {s.env_name} | {_num(s.median_tok_s)} | {reps} | {_num(s.spread, '.1%')} | "
            f"{_ci(s)} | {_num(s.accept_length, '.2f')} | {exact} | {says} |"
        )
    lines += load_markdown(decision, cfg)
    lines += policy_markdown(decision.policy, cfg)
    lines += lossless_markdown(decision, result, cfg)
    lines += breakeven_markdown(decision.breakeven)
    per_pos = [s for s in decision.configs if s.accept_per_position]
    if per_pos:
        width = max(len(s.accept_per_position or []) for s in per_pos)
        lines += ["", "## Acceptance per draft position", ""]
        lines.append("| config | " + " | ".join(f"pos {k + 1}" for k in range(width)) + " |")
        lines.append("|---|" + "---|" * width)
        for s in per_pos:
            cells = [f"{p:.2f}" for p in s.accept_per_position or []] + ["-"] * width
            lines.append(f"| {s.name} | " + " | ".join(cells[:width]) + " |")
    per_domain = [s for s in decision.configs if s.accept_length_per_domain]
    if per_domain:
        domains = sorted({d for s in per_domain for d in s.accept_length_per_domain})
        lines += ["", "## Accept length per domain", ""]
        lines.append("| config | " + " | ".join(domains) + " |")
        lines.append("|---|" + "---|" * len(domains))
        for s in per_domain:
            lines.append(f"| {s.name} | " + " | ".join(_num(s.accept_length_per_domain.get(d), ".2f") for d in domains) + " |")
    if cfg.engine == "local":
        lines += ["", "## Passes", "", "| config | rep | warm-up accept len | requests |", "|---|---|---|---|"]
        for x in result.launches:
            lines.append(f"| {x.config} | {x.repetition} | {_num(x.warmup_accept_length, '.2f')} | {len(x.requests)} |")
    else:
        lines += _launches_markdown(result, cfg)
    if result.stopped:
        lines += ["", f"**Stopped:** {result.stopped}"]
    lines += ["", "## Thresholds", "", "```json", json.dumps(decision.thresholds, indent=2), "```", ""]
    return "\n".join(lines)


def figure_png(fig: Any) -> bytes:
    """A matplotlib figure as PNG bytes (100 dpi, tight), the figure closed: every plot the gate
    and the benchmark reports write."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def plot_tok_s(decision: GateDecision, result: BenchResult) -> bytes:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(decision.configs)), 4.5))
    for i, s in enumerate(decision.configs):
        values = [r.tok_s for r in result.records(s.name) if r.tok_s is not None and r.error is None]
        xs = [i + 0.25 * ((k % 7) / 6 - 0.5) for k in range(len(values))]
        ax.scatter(xs, values, s=8, alpha=0.4, color="tab:gray" if s.baseline else "tab:blue")
        ax.scatter([i] * len(s.rep_medians), s.rep_medians, marker="_", s=300, color="black")
        if s.median_tok_s is not None:
            ax.scatter([i], [s.median_tok_s], marker="D", color="tab:red" if s.name == decision.best else "black")
    base = decision.config(decision.baseline)
    if base and base.median_tok_s:
        ax.axhline(base.median_tok_s, linestyle="--", color="tab:gray", label=f"baseline median {base.median_tok_s:.1f}")
        ax.legend(loc="best")
    ax.set_xticks(range(len(decision.configs)), [s.name for s in decision.configs], rotation=30, ha="right")
    ax.set_ylabel("tok/s per request")
    ax.set_title(f"Decode speed per config (dots: requests, bars: repetition medians) - {decision.outcome}")
    return figure_png(fig)


def plot_acceptance(decision: GateDecision) -> bytes:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    specs = [s for s in decision.configs if not s.baseline]
    with_pos = [s for s in specs if s.accept_per_position]
    for s in with_pos:
        pos = s.accept_per_position or []
        ax.plot(range(1, len(pos) + 1), pos, marker="o", label=f"{s.name} (accept len {_num(s.accept_length, '.2f')})")
    if with_pos:
        ax.set_xticks(range(1, max(len(s.accept_per_position or []) for s in with_pos) + 1))
        ax.set_xlabel("draft position")
        ax.set_ylabel("P(draft token at this position accepted)")
        ax.set_ylim(0, 1.05)
        ax.legend(loc="best", fontsize="small")
    else:  # servers older than the histogram fields: accept length only
        ax.bar([s.name for s in specs], [s.accept_length or 0.0 for s in specs])
        ax.set_ylabel("accept length (tokens per verify)")
        ax.tick_params(axis="x", rotation=30)
    ax.set_title("Acceptance per position")
    return figure_png(fig)


def plot_predicted(decision: GateDecision, predictions: dict[str, float]) -> bytes:
    import matplotlib.pyplot as plt

    pairs = [(s.name, predictions[s.name], s.median_tok_s) for s in decision.configs if s.name in predictions and s.median_tok_s]
    fig, ax = plt.subplots(figsize=(5.5, 5))
    if pairs:
        xs, ys = [p[1] for p in pairs], [p[2] for p in pairs]
        ax.scatter(xs, ys)
        for name, x, y in pairs:
            ax.annotate(name, (x, y), fontsize="small")
        hi = max(xs + ys) * 1.1
        ax.plot([0, hi], [0, hi], linestyle="--", color="tab:gray")
    ax.set_xlabel("predicted tok/s")
    ax.set_ylabel("measured median tok/s")
    ax.set_title("Predicted vs measured")
    return figure_png(fig)


def plot_breakeven(breakeven: dict[str, Any]) -> bytes:
    """Decode tok/s against the accept length reached, per num_steps: measured (simulated
    acceptance) and the cost model's line, with the baseline's level."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    base = breakeven["baseline_decode_tok_s"]
    for k, row in breakeven["per_steps"].items():
        pts = sorted((p["accept_length"], p["decode_tok_s"]) for p in row["points"])
        if not pts:
            continue
        line = ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"num_steps {k} measured")[0]
        if row.get("model_cycle_s"):
            xs = [1.0, max(x for x, _ in pts)]
            ax.plot(xs, [x / row["model_cycle_s"] for x in xs], linestyle=":", color=line.get_color(),
                    label=f"num_steps {k} cost model")  # fmt: skip
        if row.get("break_even") is not None:
            ax.axvline(row["break_even"], color=line.get_color(), linestyle="--", alpha=0.5)
    ax.axhline(base, color="tab:gray", linestyle="--", label=f"baseline {base:.1f} tok/s")
    ax.set_xlabel("accept length (tokens per verify)")
    ax.set_ylabel("decode tok/s")
    ax.set_title("Break-even on this server (acceptance forced)")
    ax.legend(loc="best", fontsize="small")
    return figure_png(fig)


def plot_load(decision: GateDecision) -> bytes:
    """Output tok/s over the wall time against concurrency per config (log-log), the baseline
    dashed, each config's crossover marked where it stops paying."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    for s in decision.configs:
        pts = sorted((lv.level, lv.throughput_tok_s) for lv in s.levels.values() if lv.throughput_tok_s)
        if len(pts) < 2 or s.role not in ("candidate", "policy", "incumbent", "challenger"):
            continue
        style = {"linestyle": "--", "color": "black"} if s.baseline else {"marker": "o"}
        line = ax.plot([c for c, _ in pts], [t for _, t in pts], label=s.name, **style)[0]
        if s.crossover and s.crossover.get("crossover"):
            ax.axvline(s.crossover["crossover"], color=line.get_color(), linestyle=":", alpha=0.7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tok/s over the wall time")
    ax.set_title(f"Throughput by load (dotted: where a config stops paying) - {decision.outcome}")
    ax.legend(loc="best", fontsize="small")
    return figure_png(fig)


def write_gate_report(
    run: RunFolder,
    decision: GateDecision,
    result: BenchResult,
    cfg: GateConfig,
    predictions: dict[str, float] | None = None,
    extra_markdown: str = "",
) -> dict[str, Any]:
    """Write the report and plots; returns their relative paths. `extra_markdown` is appended
    to report.md (the stage's offline replay and cost model section)."""
    import matplotlib

    matplotlib.use("Agg")
    report = {
        "written_at": time.time(),
        "summary": decision.summary(),
        "decision": decision.to_dict(),
        "gate_config": redact_secret_keys(cfg.model_dump()),
        "bench": redact_secret_keys(result.to_dict()),
        "predictions": predictions,
    }
    run.write_bytes_atomic(REPORT_JSON, (json.dumps(report, indent=2, default=str) + "\n").encode())
    run.write_bytes_atomic(REPORT_MD, (render_markdown(decision, result, cfg) + extra_markdown).encode())
    plots = {"tok_s": plot_tok_s(decision, result), "acceptance": plot_acceptance(decision)}
    if predictions:
        plots["predicted_vs_measured"] = plot_predicted(decision, predictions)
    if decision.breakeven and decision.breakeven.get("per_steps"):
        plots["breakeven"] = plot_breakeven(decision.breakeven)
    if len(cfg.concurrency) > 1:
        plots["load"] = plot_load(decision)
    paths = []
    for name, data in plots.items():
        rel = f"{PLOTS}/{name}.png"
        run.write_bytes_atomic(rel, data)
        paths.append(rel)
    return {"report_json": REPORT_JSON, "report_md": REPORT_MD, "plots": paths}
