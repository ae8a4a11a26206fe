"""The gate stage (DESIGN §6), in order: preflight the exported draft against the sweep, replay
it offline on the held-out extracted sequences, benchmark baseline vs speculative (the local
engine, fresh SGLang launches, or the emulator), decide, write the report, promote or keep the
previous draft, and optionally trace the data-scaling curve.

Everything lands under <run_root>/gate/: replay.json (acceptance per num_steps, overall and
per domain, with CIs), costs.json and prediction.json (the cost model, local engine),
report.json/.md and plots/, scaling/ (when asked), and promoted.json on promotion.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.gate.cost_model import CostModelError, Prediction, StepCosts, calibrate_overhead, predict
from tasks.gate.decision import GateDecision, decide
from tasks.gate.plan import (
    BenchConfig,
    BenchResult,
    encoder_for_target,
    load_bench_prompts,
    plan_configs,
)
from tasks.gate.preflight import preflight_sweep
from tasks.gate.promote import promote
from tasks.gate.replay import ReplayResult, replay
from tasks.gate.report import write_gate_report
from tasks.runfolder import RunFolder
from tasks.runfolder.layout import GATE_DONE, TRAIN_FINAL

if TYPE_CHECKING:
    from tasks.config import EagleScaleConfig
    from tasks.draft.model import Eagle3Draft

log = logging.getLogger(__name__)

DRAFT_KEY = TRAIN_FINAL
REPLAY_KEY = "gate/replay.json"
COSTS_KEY = "gate/costs.json"
PREDICTION_KEY = "gate/prediction.json"
DONE_KEY = GATE_DONE


@dataclass
class GateOutcome:
    summary: dict[str, Any]  # promote()'s: the decision's key numbers, promoted or not, message
    decision: GateDecision
    replay: dict[str, Any]
    prediction: dict[str, Any] | None
    report: dict[str, Any]
    scaling: dict[str, Any] | None = None


def gate_identity(run: RunFolder, config: EagleScaleConfig) -> dict[str, str]:
    """What a decision is about: the exported draft's content and the gate's settings."""
    from tasks.gate.promote import draft_files
    from tasks.runfolder import content_hash

    files = draft_files(run.fs, run.path(DRAFT_KEY)) if run.exists(f"{DRAFT_KEY}/config.json") else {}
    return {
        "draft": content_hash({k: v["sha256"] for k, v in files.items()}),
        "gate": content_hash(config.gate.model_dump(mode="json")),
    }


def completed_gate(config: EagleScaleConfig) -> dict[str, Any] | None:
    """The recorded summary when this draft was already decided with these settings: a resumed
    run does not benchmark (hours on SGLang) or promote again."""
    run = RunFolder(config.run_root, config.storage_options)
    done = run.read_json(DONE_KEY)
    if done is None or done.get("identity") != gate_identity(run, config):
        return None
    return done["summary"]


def materialize_draft(run: RunFolder, dest: Path) -> Path:
    """A local copy of the exported draft (train/final): engines and servers read local paths."""
    names = run.listdir(DRAFT_KEY)
    if "config.json" not in names:
        raise FileNotFoundError(f"{run.url}/{DRAFT_KEY} holds no exported draft: run the train stage first")
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:  # streamed: a production draft's weights are gigabytes
        run.fs.get_file(run.path(f"{DRAFT_KEY}/{name}"), str(dest / name))
    return dest


def load_draft(model_path: str, draft_dir: Path) -> Eagle3Draft:
    from tasks.draft.export import load_exported
    from tasks.draft.target_heads import load_target_heads

    embed, _ = load_target_heads(model_path)
    return load_exported(draft_dir, embed_weight=embed.float()).eval()


def offline_replay(run: RunFolder, config: EagleScaleConfig, draft: Eagle3Draft) -> ReplayResult:
    from tasks.extract.storage import iter_extracted

    gate = config.gate
    seqs = itertools.islice(iter_extracted(run, "eval"), gate.replay_sequences)
    result = replay(draft, seqs, gate.num_steps, n_bootstrap=gate.n_bootstrap, seed=gate.bootstrap_seed,
                    ci_level=gate.ci_level)  # fmt: skip
    if not result.sequences:
        raise ValueError(f"{run.url}/extract has no committed 'eval' sequences to replay")
    run.write_json_atomic(REPLAY_KEY, result.to_dict())
    return result


def _benchmark_local(
    config: EagleScaleConfig, draft_dir: Path, configs: list[BenchConfig], prompts: list[Any]
) -> tuple[BenchResult, dict[str, Any]]:
    import torch

    from tasks.engines.local_spec import SpecEngine
    from tasks.engines.local_spec_bench import measure_step_costs
    from tasks.gate.local import LocalGateRunner

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
    config: EagleScaleConfig, configs: list[BenchConfig], prompts: list[Any], work_dir: Path
) -> BenchResult:
    from tasks.gate.protocol import GateRunner
    from tasks.gate.server import EmulatedLauncher, Launcher, SGLangLauncher

    gate = config.gate
    launcher: Launcher
    if gate.engine == "sglang":
        launcher = SGLangLauncher(gate.sglang_version, gate.python)
    else:
        launcher = EmulatedLauncher(gate.sglang_version, dict(gate.emulator))
    logs = work_dir / "server-logs"
    logs.mkdir(parents=True, exist_ok=True)
    from tasks.target import resolve_model_dir

    # Servers load a local HF folder: a package or GGUF target is its converted folder.
    model_dir = str(resolve_model_dir(config.target.model_path, config.target.revision))
    return GateRunner(gate, launcher, model_dir, configs, prompts, logs).run()


def calibrated_prediction(costs: dict[str, Any], decision: GateDecision, replayed: ReplayResult) -> Prediction | None:
    """Replay acceptance over the measured step costs, host overhead calibrated on the measured
    baseline (the one number taken from the benchmark; every speculative figure is predicted)."""
    baseline = decision.config(decision.baseline)
    lengths = replayed.accept_lengths()
    if baseline is None or baseline.median_tok_s is None or not lengths:
        return None
    try:
        return predict(calibrate_overhead(StepCosts.from_dict(costs), baseline.median_tok_s), lengths)
    except CostModelError as e:
        log.warning("no prediction: %s", e)
        return None


def prediction_markdown(replayed: ReplayResult, prediction: Prediction | None) -> str:
    lines = ["", "## Offline replay and cost model", "",
             "| num_steps | replay accept length (CI) | predicted tok/s | predicted speedup | break-even accept length |",
             "|---|---|---|---|---|"]  # fmt: skip
    for k, row in replayed.overall.items():
        length = row["accept_length"]
        ci = f"{length:.3f} ({row['ci_low']:.3f}-{row['ci_high']:.3f})" if length is not None else "-"
        p = prediction.per_steps.get(k) if prediction else None
        cells = [f"{p['tok_s']:.1f}", f"{p['speedup']:.3f}x", f"{p['break_even_accept_length']:.3f}"] if p else ["-"] * 3
        lines.append(f"| {k} | {ci} | " + " | ".join(cells) + " |")
    lines += ["", "Replay accept length per domain:", ""]
    for domain, table in replayed.per_domain.items():
        per_k = ", ".join(f"k={k}: {r['accept_length']:.2f}" for k, r in table.items() if r["accept_length"] is not None)
        lines.append(f"- {domain}: {per_k}")
    if prediction is not None:
        best = prediction.best_num_steps
        lines.append(f"\nPredicted best num_steps: {best if best is not None else 'none beats the baseline'}.")
    return "\n".join(lines) + "\n"


def _scaling(run: RunFolder, config: EagleScaleConfig, replayed: ReplayResult, prediction: Prediction | None) -> dict[str, Any]:
    from tasks.extract.storage import extract_metadata
    from tasks.gate.scaling import OVERALL, ScalingPoint, train_at_fractions, write_scaling_report

    k = (prediction.best_num_steps if prediction else None) or max(config.gate.num_steps)
    points = train_at_fractions(run, config.train, config.target.model_path, config.gate.scaling_fractions, num_steps=k)
    # The full-data point is the trained draft itself, replayed above: not trained again.
    n_train = int(extract_metadata(run)["splits"].get("train", 0))
    tables = {OVERALL: replayed.overall, **replayed.per_domain}
    points += [ScalingPoint(d, n_train, t[k]["accept_length"]) for d, t in tables.items()
               if t[k]["accept_length"] is not None]  # fmt: skip
    break_even = prediction.per_steps[k]["break_even_accept_length"] if prediction and k in prediction.per_steps else None
    return write_scaling_report(run, points, break_even, k)


def run_gate_stage(config: EagleScaleConfig, work_dir: Path) -> GateOutcome:
    """The whole gate for the run's exported draft. Raises PreflightError before any benchmark
    when the draft does not fit the sweep; a benchmark that cannot give valid evidence (acceptance
    below the floor, a server that does not echo its launch) ends in a "stopped" decision."""
    from tasks.extract.storage import extract_metadata
    from tasks.target import read_model_config, resolve_model_dir, text_config

    gate, run = config.gate, RunFolder(config.run_root, config.storage_options)
    identity = gate_identity(run, config)  # the draft as benchmarked, hashed once
    draft_dir = materialize_draft(run, work_dir / "draft")
    target_config = text_config(read_model_config(resolve_model_dir(config.target.model_path)))
    configs = plan_configs(gate, str(draft_dir))
    specs = [c.spec for c in configs if c.spec is not None and (gate.engine != "local" or c.spec.topk == 1)]
    preflight_sweep(str(draft_dir), specs, target_config, extract_metadata(run)["aux_layer_ids"])
    replayed = offline_replay(run, config, load_draft(config.target.model_path, draft_dir))
    encode = encoder_for_target(config.target.model_path, config.target.chat_template)
    prompts = load_bench_prompts(run, gate.num_prompts, gate.prompt_seed, encode)
    costs = None
    if gate.engine == "local":
        result, costs = _benchmark_local(config, draft_dir, configs, prompts)
        run.write_json_atomic(COSTS_KEY, costs)
    else:
        result = _benchmark_server(config, configs, prompts, work_dir)
    decision = decide(result, gate)
    prediction = calibrated_prediction(costs, decision, replayed) if costs else None
    if prediction is not None:
        run.write_json_atomic(PREDICTION_KEY, prediction.to_dict())
    report = write_gate_report(
        run, decision, result, gate, prediction.gate_predictions() if prediction else None,
        extra_markdown=prediction_markdown(replayed, prediction),
    )  # fmt: skip
    summary = promote(
        run, decision, f"{run.url}/{DRAFT_KEY}", gate.registry_url,
        registry_storage_options=gate.registry_storage_options, draft_storage_options=config.storage_options,
    )  # fmt: skip
    scaling = _scaling(run, config, replayed, prediction) if gate.scaling_fractions else None
    run.write_json_atomic(DONE_KEY, {"identity": identity, "summary": summary})
    pred = prediction.to_dict() if prediction else None
    return GateOutcome(summary, decision, replayed.to_dict(), pred, report, scaling)
