"""The gate stage (docs/GATE.md), in order: preflight every draft it measures (the candidate, the
train stage's data-scaling drafts; the incumbent and the challengers, left out with the reason
when they fail) against its configs, replay the candidate offline on the held-out extracted
sequences, benchmark baseline vs speculative (the local engine, fresh SGLang launches, or the
emulator), decide (the candidate must beat the baseline and the incumbent), write the report,
promote or keep the previous draft, and trace the data-scaling curve when the train stage made
scaling drafts.

Everything lands under <run_root>/gate/: replay.json (acceptance per num_steps, overall and
per domain, with CIs), costs.json and prediction.json (the cost model: the local engine's timed
steps, or the server launches' cost probes), report.json/.md and plots/, server-logs/ (server
engines), scaling/ (with scaling drafts), progress.json (where it is while it runs) and
_SUCCESS.json; promoted.json goes to the run root.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tasks.gate.contenders import find_contenders, run_target
from tasks.gate.cost_model import CostModelError, Prediction, StepCosts, calibrate_overhead, predict
from tasks.gate.decision import GateDecision, decide
from tasks.gate.load import load_record
from tasks.gate.plan import SCALING, BenchConfig, ExtraDraft, Incumbent, LeftOut, plan_configs
from tasks.gate.preflight import preflight_sweep
from tasks.gate.progress import GateProgress, Logger
from tasks.gate.promote import promote
from tasks.gate.prompts import encoder_for_target, load_bench_prompts
from tasks.gate.records import BenchResult
from tasks.gate.replay import ReplayResult, replay_run
from tasks.gate.report import load_prediction_markdown, write_gate_report
from tasks.gate.serving_policy import (
    ADAPTIVE,
    ServingPolicy,
    build_policy,
    close_rehearsal,
    judge,
    policy_launches,
    write_policy,
)
from tasks.runfolder import RunFolder
from tasks.runfolder.layout import GATE_DONE, TRAIN_FINAL

if TYPE_CHECKING:
    from tasks.config import EagleScaleConfig
    from tasks.config.gate_section import GateConfig
    from tasks.draft.model import Eagle3Draft
    from tasks.gate.benchmark import GateRunner

log = logging.getLogger(__name__)

REPLAY_KEY = "gate/replay.json"
COSTS_KEY = "gate/costs.json"
PREDICTION_KEY = "gate/prediction.json"
LOAD_KEY = "gate/load.json"


@dataclass
class GateOutcome:
    summary: dict[str, Any]  # promote()'s: the decision's key numbers, promoted or not, message
    decision: GateDecision
    replay: dict[str, Any]
    prediction: dict[str, Any] | None
    report: dict[str, Any]
    scaling: dict[str, Any] | None = None


def draft_sha(run: RunFolder) -> dict[str, str]:
    """{file: sha256} of the exported draft (empty before the train stage exported one)."""
    from tasks.gate.promote import draft_files

    files = draft_files(run.fs, run.path(TRAIN_FINAL)) if run.exists(f"{TRAIN_FINAL}/config.json") else {}
    return {k: v["sha256"] for k, v in files.items()}


def gate_identity(run: RunFolder, config: EagleScaleConfig, sha: dict[str, str] | None = None) -> dict[str, str]:
    """What a decision is about: the exported draft's content and the gate's settings."""
    from tasks.runfolder import content_hash

    return {
        "draft": content_hash(draft_sha(run) if sha is None else sha),
        "gate": content_hash(config.gate.model_dump(mode="json")),
    }


def completed_gate(config: EagleScaleConfig) -> dict[str, Any] | None:
    """The recorded summary when this draft was already decided with these settings: a resumed
    run does not benchmark (hours on SGLang) or promote again."""
    run = RunFolder(config.run_root, config.storage_options)
    done = run.read_json(GATE_DONE)
    if done is None or done.get("identity") != gate_identity(run, config):
        return None
    return done["summary"]


def materialize_draft(run: RunFolder, dest: Path, key: str = TRAIN_FINAL) -> Path:
    """A local copy of an exported draft (train/final by default): engines and servers read
    local paths."""
    names = run.listdir(key)
    if "config.json" not in names:
        raise FileNotFoundError(f"{run.url}/{key} holds no exported draft: run the train stage first")
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:  # streamed: a production draft's weights are gigabytes
        run.fs.get_file(run.path(f"{key}/{name}"), str(dest / name))
    return dest


def load_draft(embed: torch.Tensor, draft_dir: Path, device: str = "cpu") -> Eagle3Draft:
    """An exported draft with the target's embedding (exports do not hold it; SGLang shares the
    target's), for replay. The gate reads the embedding once for all its drafts."""
    from tasks.draft.export import load_exported

    return load_exported(draft_dir, embed_weight=embed.float()).eval().to(device)


def replay_steps(config: EagleScaleConfig, run: RunFolder) -> list[int]:
    """The num_steps replayed: the sweep's, and the scaling curve's when there is a curve."""
    from tasks.draft.scaling_drafts import scaling_drafts

    steps = set(config.gate.num_steps)
    if scaling_drafts(run):
        steps.add(config.gate.scaling_num_steps)
    return sorted(steps)


def replay_draft(
    run: RunFolder, config: EagleScaleConfig, embed: torch.Tensor, draft_dir: Path, num_steps: list[int]
) -> ReplayResult:
    """One exported draft over the first gate.replay_sequences held-out sequences, on
    gate.device (on a GPU node the draft's unroll takes seconds there and minutes on the CPU:
    a gate once spent them before its first launch: BENCHMARKS P8)."""
    from tasks.draft.data import training_data_metadata
    from tasks.draft.online import OnlineTarget, online_sequences

    gate = config.gate
    draft = load_draft(embed, draft_dir, gate.device)
    sequences = None
    if training_data_metadata(run).get("hidden_states") == "online":
        # No extract shards: the target (on gate.device) captures the held-out states again.
        sequences = online_sequences(run, OnlineTarget.of(config), torch.device(gate.device), "eval",
                                     gate.replay_sequences)  # fmt: skip
    try:
        return replay_run(run, draft, num_steps, limit=gate.replay_sequences, sequences=sequences,
                          n_bootstrap=gate.n_bootstrap, seed=gate.bootstrap_seed, ci_level=gate.ci_level)  # fmt: skip
    finally:
        del draft
        if gate.device.startswith("cuda"):  # the servers launched next measure the GPU's free memory
            torch.cuda.empty_cache()


def offline_replay(run: RunFolder, config: EagleScaleConfig, embed: torch.Tensor, draft_dir: Path) -> ReplayResult:
    result = replay_draft(run, config, embed, draft_dir, replay_steps(config, run))
    run.write_json_atomic(REPLAY_KEY, result.to_dict())
    return result


def _benchmark_local(
    config: EagleScaleConfig, draft_dir: Path, configs: list[BenchConfig], prompts: list[Any]
) -> tuple[BenchResult, dict[str, Any]]:
    import torch

    from tasks.gate.local_benchmark import LocalGateRunner
    from tasks.gate.spec_engine import SpecEngine
    from tasks.gate.spec_engine_measure import measure_step_costs

    gate = config.gate
    on_cuda = gate.device.startswith("cuda")
    # The static KV cache is read whole at every step: size it to the longest request, not
    # the model's context, or attention over empty slots dominates a small target's step.
    max_len = max(len(p.input_ids) for p in prompts) + gate.max_new_tokens + max(gate.num_steps) + 2
    engine = SpecEngine.from_pretrained(
        config.target.model_path, str(draft_dir), device=gate.device, max_len=max_len,
        dtype=torch.bfloat16 if on_cuda else torch.float32, use_cuda_graphs=on_cuda and gate.cuda_graphs,
    )  # fmt: skip
    threads = torch.get_num_threads()
    if not on_cuda:
        # Batch-1 decode of a small model is latency-bound: intra-op threads only add sync
        # points, and on a shared box they turn other processes' load into run-to-run noise.
        torch.set_num_threads(1)
    try:
        costs = measure_step_costs(engine, gate.num_steps, iters=gate.cost_iters)
        return LocalGateRunner(gate, engine, configs, prompts).run(), costs
    finally:
        torch.set_num_threads(threads)


def _benchmark_server(
    config: EagleScaleConfig, configs: list[BenchConfig], prompts: list[Any], work_dir: Path, progress: GateProgress
) -> tuple[GateRunner, BenchResult]:
    from tasks.gate.benchmark import GateRunner, server_launcher
    from tasks.target.model_dir import resolve_model_dir

    gate = config.gate
    launcher = server_launcher(gate)
    logs = work_dir / "server-logs"
    logs.mkdir(parents=True, exist_ok=True)
    # Servers load a local HF folder: a package or GGUF target is its converted folder.
    model_dir = str(resolve_model_dir(config.target.model_path, config.target.revision))
    runner = GateRunner(gate, launcher, model_dir, configs, prompts, logs, progress)
    return runner, runner.run()


def decide_server(
    gate: GateConfig, runner: GateRunner, result: BenchResult, draft_dir: Path, work_dir: Path,
    incumbent: Incumbent | None = None, left_out: Sequence[LeftOut] = (), progress: GateProgress | None = None,
) -> tuple[GateDecision, ServingPolicy | None]:  # fmt: skip
    """The sweep's decision and the serving policy it supports; an adaptive policy of a draft
    the sweep would promote is launched and measured at every level (runner.run_more), then
    the policy is judged and the outcome settled (serving_policy.judge)."""
    decision = decide(result, gate, incumbent, left_out)
    policy = build_policy(decision, gate)
    if policy is not None and policy.kind == ADAPTIVE and decision.promote and result.stopped is None:
        if progress is not None:
            progress.phase("policy", "the serving policy's own launch pair, at every load level")
        runner.run_more(policy_launches(policy, gate, str(draft_dir), work_dir), result)
        decision = decide(result, gate, incumbent, left_out)
        policy = build_policy(decision, gate)
    policy = judge(decision, gate, policy)
    close_rehearsal(decision, gate)
    return decision, policy


def calibrated_prediction(costs: dict[str, Any], decision: GateDecision, replayed: ReplayResult) -> Prediction | None:
    """Local engine: replay acceptance over the measured step costs, host overhead calibrated on
    the measured baseline (the one number taken from the benchmark; every speculative figure is
    predicted)."""
    baseline = decision.config(decision.baseline)
    lengths = replayed.accept_lengths()
    if baseline is None or baseline.median_tok_s is None or not lengths:
        return None
    try:
        step_costs = StepCosts.from_dict(costs)
        lengths = {k: v for k, v in lengths.items() if step_costs.covers(k)}
        return predict(calibrate_overhead(step_costs, baseline.median_tok_s), lengths)
    except CostModelError as e:
        log.warning("no prediction: %s", e)
        return None


def server_prediction(result: BenchResult, replayed: ReplayResult) -> tuple[dict[str, Any] | None, Prediction | None]:
    """Server engines: replay acceptance over the cycle costs the launches' cost probes timed,
    per request (prefill included) at the baseline's median completion length. No number of the
    measured requests enters it."""
    from tasks.gate.cost_model import costs_from_launches

    try:
        costs = costs_from_launches(result)
    except CostModelError as e:
        log.warning("no step costs: %s", e)
        return None, None
    lengths = {k: v for k, v in replayed.accept_lengths().items() if costs.covers(k)}
    tokens = probe_tokens(result)
    try:
        return costs.to_dict(), predict(costs, lengths, tokens) if lengths else None
    except CostModelError as e:
        log.warning("no prediction: %s", e)
        return costs.to_dict(), None


def probe_tokens(result: BenchResult) -> float | None:
    """Tokens per request the prediction is made for: the baseline's concurrency-1 probes' median."""
    probes = [r.completion_tokens for x in result.launches for r in x.probes
              if x.config.split("@")[0] == "baseline" and r.error is None and r.completion_tokens > 1
              and r.concurrency == 1]  # fmt: skip
    return float(statistics.median(probes)) if probes else None


def prediction_markdown(replayed: ReplayResult, prediction: Prediction | None, decision: GateDecision) -> str:
    lines = ["", "## Offline replay and cost model", "",
             "| num_steps | replay accept length (CI) | measured accept length | predicted tok/s | measured tok/s | error | predicted speedup | break-even accept length |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    measured = {c.spec["num_steps"]: c for c in decision.configs if c.spec and c.is_candidate_chain()}
    for k, row in replayed.overall.items():
        length = row["accept_length"]
        ci = f"{length:.3f} ({row['ci_low']:.3f}-{row['ci_high']:.3f})" if length is not None else "-"
        p = prediction.per_steps.get(k) if prediction else None
        m = measured.get(k)
        m_len = f"{m.accept_length:.3f}" if m and m.accept_length is not None else "-"
        m_tok = m.median_tok_s if m else None
        cells = [f"{p['tok_s']:.1f}" if p else "-", f"{m_tok:.1f}" if m_tok else "-",
                 f"{(p['tok_s'] / m_tok - 1):+.1%}" if p and m_tok else "-",
                 f"{p['speedup']:.3f}x" if p else "-", f"{p['break_even_accept_length']:.3f}" if p else "-"]  # fmt: skip
        lines.append(f"| {k} | {ci} | {m_len} | " + " | ".join(cells) + " |")
    lines += ["", "Replay accept length per domain:", ""]
    for domain, table in replayed.per_domain.items():
        per_k = ", ".join(f"k={k}: {r['accept_length']:.2f}" for k, r in table.items() if r["accept_length"] is not None)
        lines.append(f"- {domain}: {per_k}")
    if prediction is not None:
        best = prediction.best_num_steps
        lines.append(f"\nPredicted best num_steps: {best if best is not None else 'none beats the baseline'}.")
        lines.append(break_even_statement(decision, prediction))
    return "\n".join(lines) + "\n"


def break_even_statement(decision: GateDecision, prediction: Prediction) -> str:
    """By how much the best measured topk=1 config beats (or trails) the baseline, and the accept
    length it would need to break even at its measured cycle cost."""
    rows = [c for c in decision.configs if c.spec and c.is_candidate_chain()
            and c.spec["num_steps"] in prediction.per_steps and c.speedup is not None]  # fmt: skip
    if not rows:
        return ""
    best = max(rows, key=lambda c: c.speedup or 0.0)
    k = best.spec["num_steps"] if best.spec else 0
    need = prediction.per_steps[k]["break_even_accept_length"]
    verb = "faster" if (best.speedup or 0) >= 1 else "slower"
    return (
        f"\nBest measured chain config {best.name}: {abs((best.speedup or 1) - 1):.1%} {verb} than the "
        f"baseline at accept length {best.accept_length:.2f}; at its cycle cost an accept length of "
        f"{need:.2f} breaks even (k={k}: at most {k + 1} tokens per verify)."
    )


def materialize_scaling_drafts(run: RunFolder, work_dir: Path) -> dict[int, Path]:
    """The train stage's data-scaling drafts, copied once into `work_dir` (servers and replay
    read local folders), by training samples."""
    from tasks.draft.scaling_drafts import scaling_drafts

    return {int(e["samples"]): materialize_draft(run, work_dir / f"scaling-{e['samples']}", e["final"])
            for e in scaling_drafts(run)}  # fmt: skip


def scaling_extra(config: EagleScaleConfig, scaling_dirs: dict[int, Path]) -> list[ExtraDraft]:
    """The data-scaling drafts, measured beside the candidate on server engines (the local
    engine replays them only)."""
    gate = config.gate
    if gate.engine == "local":
        return []
    return [ExtraDraft(f"scaling-{samples}", str(local), gate.scaling_num_steps, role=SCALING, samples=samples)
            for samples, local in scaling_dirs.items()]  # fmt: skip


def scaling_replays(
    run: RunFolder, config: EagleScaleConfig, embed: torch.Tensor, scaling_dirs: dict[int, Path]
) -> dict[int, ReplayResult]:
    """Each data-scaling draft replayed at gate.scaling_num_steps, before the first launch (a
    gate cut short keeps the curve's replayed half: BENCHMARKS P8), recorded at once in gate/scaling/replay.json."""
    from tasks.gate.scaling import SCALING_ROOT

    out = {samples: replay_draft(run, config, embed, local, [config.gate.scaling_num_steps])
           for samples, local in scaling_dirs.items()}  # fmt: skip
    if out:
        run.write_json_atomic(f"{SCALING_ROOT}/replay.json", {str(n): r.to_dict() for n, r in out.items()})
    return out


def _scaling(
    run: RunFolder, config: EagleScaleConfig, replayed: ReplayResult, replays: dict[int, ReplayResult],
    decision: GateDecision, prediction: Prediction | None,
) -> dict[str, Any] | None:
    """The curve over the train stage's scaling drafts and the full draft, at
    gate.scaling_num_steps: replayed for every draft, measured where a server measured it."""
    from tasks.draft.data import training_data_metadata
    from tasks.draft.forecast import forecast_beside
    from tasks.gate.scaling import (
        MEASURED,
        OVERALL,
        ScalingPoint,
        replay_points,
        write_scaling_report,
    )

    if not replays:
        return None
    k = config.gate.scaling_num_steps
    points: list[ScalingPoint] = []

    def add_measured(samples: int, summary: Any) -> None:
        if summary is None or summary.accept_length is None:
            return
        points.append(ScalingPoint(OVERALL, samples, summary.accept_length, MEASURED))
        points.extend(ScalingPoint(d, samples, v, MEASURED) for d, v in summary.accept_length_per_domain.items())

    for samples, result in replays.items():
        points.extend(replay_points(samples, result.overall, result.per_domain, k))
        add_measured(samples, next((c for c in decision.configs if c.role == SCALING and c.samples == samples), None))
    n_train = int(training_data_metadata(run)["splits"].get("train", 0))
    points.extend(replay_points(n_train, replayed.overall, replayed.per_domain, k))  # the full draft: offline_replay covers scaling_num_steps
    full = next((c for c in decision.configs if c.spec and c.is_candidate_chain() and c.spec["num_steps"] == k), None)
    add_measured(n_train, full)
    break_even = prediction.per_steps[k]["break_even_accept_length"] if prediction and k in prediction.per_steps else None
    # The full draft's pre-registered forecast (train.forecast_full_draft) beside its measurements.
    beside = forecast_beside(run, k, {"replay": (replayed.overall.get(k) or {}).get("accept_length"),
                                      "server": full.accept_length if full is not None else None})  # fmt: skip
    return write_scaling_report(run, points, break_even, k, pre_registered=beside)


def run_gate_stage(config: EagleScaleConfig, work_dir: Path, logger: Logger | None = None) -> GateOutcome:
    """The whole gate for the run's exported draft. Raises PreflightError before any benchmark
    when a draft does not fit its configs; a benchmark that cannot give valid evidence
    (acceptance below the floor, a server that does not echo its launch) ends in a "stopped"
    decision. Where it is goes to gate/progress.json and to `logger` (tasks/gate/progress.py)."""
    run = RunFolder(config.run_root, config.storage_options)
    progress = GateProgress(run, logger)
    try:
        outcome = _gate(config, run, work_dir, progress)
    except BaseException as e:
        progress.finished("failed", f"{type(e).__name__}: {e}")
        raise
    progress.finished("done", outcome.summary["message"])
    return outcome


def run_gate_once(
    config: EagleScaleConfig,
    logger: Logger | None = None,
    *,
    hold: AbstractContextManager[Any] | None = None,
    on_start: Callable[[], None] | None = None,
) -> GateOutcome | dict[str, Any]:
    """The gate as every runner runs it (the flow, the H200 runner's plain entry points): the
    recorded summary when this draft was already decided with these settings (completed_gate:
    nothing is benchmarked or promoted again); else `on_start`, then run_gate_stage in a scratch
    folder removed after, while `hold` is held (the flow's GPU slots)."""
    done = completed_gate(config)
    if done is not None:
        return done
    if on_start is not None:
        on_start()
    with hold or nullcontext(), tempfile.TemporaryDirectory(prefix="eaglescale-gate-") as tmp:
        return run_gate_stage(config, Path(tmp), logger)


def _gate(config: EagleScaleConfig, run: RunFolder, work_dir: Path, progress: GateProgress) -> GateOutcome:
    from tasks.draft.data import training_data_metadata
    from tasks.draft.target_heads import load_target_heads
    from tasks.target.model_dir import read_model_config, resolve_model_dir, text_config

    gate = config.gate
    progress.phase("preflight")
    sha = draft_sha(run)  # the draft as benchmarked, hashed once
    identity = gate_identity(run, config, sha)
    draft_dir = materialize_draft(run, work_dir / "draft")
    target_config = text_config(read_model_config(resolve_model_dir(config.target.model_path)))
    scaling_dirs = materialize_scaling_drafts(run, work_dir)  # once, for the launches and replay
    # The incumbent and the challengers, preflight-checked here: one that fails is left out, reported.
    contenders = find_contenders(config, run, work_dir, sha, target_config)
    ours = scaling_extra(config, scaling_dirs)
    configs = plan_configs(gate, str(draft_dir), contenders.drafts + ours)
    aux_ids = training_data_metadata(run)["aux_layer_ids"]
    # The run's own drafts are checked against their configs before anything is launched.
    for path in dict.fromkeys([str(draft_dir), *(d.path for d in ours)]):
        specs = [c.spec for c in configs if c.spec is not None and c.spec.draft_model_path == path
                 and (gate.engine != "local" or c.spec.topk == 1)]  # fmt: skip
        preflight_sweep(path, specs, target_config, aux_ids)
    progress.phase("replay", f"the draft and its data-scaling drafts over up to {gate.replay_sequences} held-out sequences")
    embed, _ = load_target_heads(config.target.model_path)  # once, for every draft replayed
    replayed = offline_replay(run, config, embed, draft_dir)
    replays = scaling_replays(run, config, embed, scaling_dirs)
    del embed
    encode = encoder_for_target(config.target.model_path, config.target.chat_template)
    prompts = load_bench_prompts(run, gate.num_prompts, gate.prompt_seed, encode)
    progress.phase("benchmark", f"{len(configs)} configs x {gate.repetitions} repetitions on the {gate.engine} engine")
    if gate.engine == "local":
        result, costs = _benchmark_local(config, draft_dir, configs, prompts)
        decision = decide(result, gate, None, contenders.left_out)
        judge(decision, gate, build_policy(decision, gate))
        prediction = calibrated_prediction(costs, decision, replayed)
    else:
        runner, result = _benchmark_server(config, configs, prompts, work_dir, progress)
        decision, _ = decide_server(gate, runner, result, draft_dir, work_dir, contenders.incumbent,
                                    contenders.left_out, progress)  # fmt: skip
        costs, prediction = server_prediction(result, replayed)
    progress.phase("decide")
    write_policy(run, decision)
    load = None
    if len(gate.concurrency) > 1:
        load = load_record(result, decision.configs, replayed.accept_lengths(), probe_tokens(result), gate.deploy_level)
        run.write_json_atomic(LOAD_KEY, load)
    if costs is not None:
        run.write_json_atomic(COSTS_KEY, costs)
    if prediction is not None:
        run.write_json_atomic(PREDICTION_KEY, prediction.to_dict())
    report = write_gate_report(
        run, decision, result, gate, prediction.gate_predictions() if prediction else None,
        extra_markdown=prediction_markdown(replayed, prediction, decision) + load_prediction_markdown(load),
    )  # fmt: skip
    summary = promote(
        run, decision, f"{run.url}/{TRAIN_FINAL}", gate.registry_url,
        registry_storage_options=gate.registry_storage_options, draft_storage_options=config.storage_options,
        target=run_target(run),
    )  # fmt: skip
    progress.phase("scaling")
    scaling = _scaling(run, config, replayed, replays, decision, prediction)
    run.write_json_atomic(GATE_DONE, {"identity": identity, "summary": summary})
    pred = prediction.to_dict() if prediction else None
    return GateOutcome(summary, decision, replayed.to_dict(), pred, report, scaling)
