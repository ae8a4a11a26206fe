"""The gate at load, rehearsed on a server: what a draft of given accept lengths does on this target
and server at every concurrency level, and the serving policy it would ship with.

The gate's own code runs it (tasks/gate: the sweep's launches, each measuring every level, the
per-level decision, the serving policy and its own launch pair, the per-level prediction, the
report), with `gate.simulated_acceptance`: each speculative config runs with SGLANG_SIMULATE_ACC_LEN
at its accept length (SGLang 0.5.14 runs its real draft and verify pipeline and accepts that many
tokens per verify), every request to max_new_tokens or to its prompt's --reply-tokens (a real gate's,
P35). The target has random weights of a real model's shape (`--load-format dummy`) and the draft
is random: speed does not depend on weights. Nothing is promoted: the outcome is "rehearsal".

    python3 benchmarks/load_rehearsal.py OUT_DIR [--engine sglang|emulated] [--shape qwen15b]
        [--levels 1,2,4,8,16,32,64] [--accept eagle3-s3-k1-n4=2.58,...] [--prompts 24] [--new-tokens 256]
        [--reply-tokens FILE] [--sweep-only]
    .venv/bin/python benchmarks/load_rehearsal.py --rejudge RESULTS_DIR   # a collected one, judged again

On the GPU node (SGLang 0.5.14 unpacked on PYTHONPATH) --engine sglang; here --engine emulated runs
the same protocol against the package's SGLang emulator (a batch cost model in place of the GPU).
Writes OUT_DIR/run/gate/{report.md,report.json,load.json,serving-policy.json,plots/} and
OUT_DIR/rehearsal.json (the tok/s table, crossovers, prediction errors, launches and GPU time).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tasks.config import load_config  # noqa: E402
from tasks.config.gate_section import GateConfig, SpecPoint  # noqa: E402
from tasks.gate.benchmark import GateRunner, server_launcher  # noqa: E402
from tasks.gate.decision import decide  # noqa: E402
from tasks.gate.load import load_record  # noqa: E402
from tasks.gate.plan import plan_configs  # noqa: E402
from tasks.gate.progress import GateProgress  # noqa: E402
from tasks.gate.prompts import BenchPrompt  # noqa: E402
from tasks.gate.report import load_prediction_markdown, write_gate_report  # noqa: E402
from tasks.gate.serving_policy import build_policy, close_rehearsal, write_policy  # noqa: E402
from tasks.gate.stage import LOAD_KEY, decide_server  # noqa: E402
from tasks.runfolder import RunFolder  # noqa: E402

# Shapes of real targets (their config.json's architecture numbers), with random weights.
SHAPES = {
    "qwen15b": dict(arch="Qwen2ForCausalLM", model_type="qwen2", layers=28, hidden=1536, heads=12, kv_heads=2,
                    head_dim=128, intermediate=8960, vocab=151936, tie=True, theta=1000000.0),
    "smol135m": dict(arch="LlamaForCausalLM", model_type="llama", layers=30, hidden=576, heads=9, kv_heads=3,
                     head_dim=64, intermediate=1536, vocab=49152, tie=True, theta=100000.0),
}  # fmt: skip
DRAFT_VOCAB = 32000
GATE_PROFILE = REPO / "deployments/params/qwen25-coder.yaml"  # whose gate.server a rehearsal's server is
# The promoted Qwen2.5-Coder draft's accept lengths (run 24: 2.58 at 3 steps, 2.82 at 4, the
# tree 2.96), and below and above them the curve's shape at 1, 2 and 5 steps.
DEFAULT_ACCEPT = {"eagle3-s1-k1-n2": 1.75, "eagle3-s2-k1-n3": 2.25, "eagle3-s3-k1-n4": 2.58,
                  "eagle3-s4-k1-n5": 2.82, "eagle3-s5-k1-n6": 3.0, "eagle3-s3-k4-n8": 2.96}  # fmt: skip
TREE = SpecPoint(num_steps=3, topk=4, num_draft_tokens=8)
TREE_LABEL = f"eagle3-s{TREE.num_steps}-k{TREE.topk}-n{TREE.num_draft_tokens}"


def write_models(shape: str, root: Path) -> tuple[Path, Path]:
    """A target folder (config.json only: `--load-format dummy`) and a random EAGLE-3 draft."""
    import torch
    from safetensors.torch import save_file

    s = SHAPES[shape]
    target, draft = root / f"{shape}-target", root / f"{shape}-draft"
    target.mkdir(parents=True, exist_ok=True)
    draft.mkdir(parents=True, exist_ok=True)
    h, heads, kv, hd, inter, v = s["hidden"], s["heads"], s["kv_heads"], s["head_dim"], s["intermediate"], s["vocab"]
    (target / "config.json").write_text(json.dumps({
        "architectures": [s["arch"]], "model_type": s["model_type"], "hidden_size": h, "intermediate_size": inter,
        "num_hidden_layers": s["layers"], "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
        "vocab_size": v, "max_position_embeddings": 8192, "rope_theta": s["theta"], "rms_norm_eps": 1e-6,
        "tie_word_embeddings": s["tie"], "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
        "hidden_act": "silu"}, indent=1))  # fmt: skip
    g = torch.Generator().manual_seed(0)

    def rand(*shape_: int) -> torch.Tensor:
        return (torch.randn(*shape_, generator=g) * 0.02).to(torch.bfloat16)

    ones = [f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")] + ["norm.weight"]
    weights = {"fc.weight": rand(h, 3 * h), "midlayer.self_attn.q_proj.weight": rand(heads * hd, 2 * h),
               "midlayer.self_attn.k_proj.weight": rand(kv * hd, 2 * h), "midlayer.self_attn.v_proj.weight": rand(kv * hd, 2 * h),
               "midlayer.self_attn.o_proj.weight": rand(h, heads * hd), "midlayer.mlp.gate_proj.weight": rand(inter, h),
               "midlayer.mlp.up_proj.weight": rand(inter, h), "midlayer.mlp.down_proj.weight": rand(h, inter),
               **{n: torch.ones(h, dtype=torch.bfloat16) for n in ones},
               "lm_head.weight": rand(DRAFT_VOCAB, h), "d2t": torch.zeros(DRAFT_VOCAB, dtype=torch.int64),
               "t2d": torch.cat([torch.ones(DRAFT_VOCAB, dtype=torch.bool), torch.zeros(v - DRAFT_VOCAB, dtype=torch.bool)])}  # fmt: skip
    save_file(weights, str(draft / "model.safetensors"))
    (draft / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd, "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6, "rope_theta": s["theta"], "max_position_embeddings": 8192, "vocab_size": v,
        "draft_vocab_size": DRAFT_VOCAB, "tie_word_embeddings": False, "target_hidden_size": h, "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, s["layers"] // 2 - 1, s["layers"] - 4],
                         "use_aux_hidden_state": True}}, indent=1))  # fmt: skip
    return target, draft


def random_prompts(n: int, tokens: int, seed: int = 0) -> list[BenchPrompt]:
    rng = random.Random(seed)
    return [BenchPrompt(i, f"random-{i}", "random", tuple(rng.randrange(3, 30000) for _ in range(tokens))) for i in range(n)]


def gate_config(args: argparse.Namespace, accept: dict[str, float]) -> GateConfig:
    levels = [int(c) for c in args.levels.split(",")]
    steps = sorted({int(k.split("-s")[1].split("-")[0]) for k in accept if "-k1-" in k})
    replies = json.loads(Path(args.reply_tokens).read_text()) if args.reply_tokens else []
    common = dict(engine=args.engine, sglang_version="0.5.14", python=sys.executable, concurrency=levels,
                  num_steps=steps, topk_points=[TREE] if TREE_LABEL in accept else [], simulated_acceptance=accept,
                  repetitions=args.repetitions, num_prompts=args.prompts, max_new_tokens=args.new_tokens,
                  simulated_reply_tokens=replies,
                  warmup_requests=2, acceptance_floor=1.0, verify_logprobs="off", cuda_graph_max_bs=max(levels),
                  n_bootstrap=2000, health_timeout_s=900, request_timeout_s=600)  # fmt: skip
    if args.engine == "sglang":  # the server the Qwen profile's gates launch (P36: a rehearsal's own settings differed)
        gate = load_config(GATE_PROFILE).gate
        return GateConfig(**common, server=gate.server, mem_fraction_static=gate.mem_fraction_static,
                          extra_server_args=["--load-format", "dummy", "--context-length", "4096"])  # fmt: skip
    # The emulator: a 1.5B-like cost model (ms): verify work grows with the tokens in the batch.
    emulator = {"sglang_version": "0.5.14", "prefill_s": 0.01, "baseline_step_s": 0.0022, "verify_step_s": 0.0028,
                "draft_step_s": 0.0004, "batch_token_s": 0.00004, "launch_jitter": 0.02}  # fmt: skip
    return GateConfig(**{**common, "health_timeout_s": 60}, emulator=emulator)


def rehearse(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out).resolve()
    accept = dict(DEFAULT_ACCEPT)
    if args.accept:
        accept = {k: float(v) for k, v in (item.split("=") for item in args.accept.split(","))}
    cfg = gate_config(args, accept)
    target, draft = write_models(args.shape, out / "models")
    run = RunFolder(str(out / "run"))
    prompts = random_prompts(args.prompts, args.prompt_tokens)
    started = time.time()
    # gate/progress.json after every launch: what a cut-short rehearsal still brings back.
    progress = GateProgress(run)
    runner = GateRunner(cfg, server_launcher(cfg), str(target), plan_configs(cfg, str(draft)), prompts,
                        out / "server-logs", progress)  # fmt: skip
    result = runner.run()
    if args.sweep_only:  # the sweep's per-level figures and the policy they support, not launched
        decision = decide(result, cfg)
        policy = build_policy(decision, cfg)
        if policy is not None:
            policy.reasons.append("built from the sweep, not launched (--sweep-only)")
            decision.policy = policy.to_dict()
        close_rehearsal(decision, cfg)
    else:
        decision, _ = decide_server(cfg, runner, result, draft, out, progress=progress)
    progress.finished("done", decision.outcome)
    wall = time.time() - started
    steps = {int(k.split("-s")[1].split("-")[0]): v for k, v in accept.items() if "-k1-" in k}
    record = load_record(result, decision.configs, steps, float(args.new_tokens), cfg.deploy_level)
    run.write_json_atomic(LOAD_KEY, record)
    write_policy(run, decision)
    write_gate_report(run, decision, result, cfg, extra_markdown=load_prediction_markdown(record))
    summary = {"engine": cfg.engine, "shape": args.shape, "levels": cfg.concurrency, "accept": accept,
               "launches": len(result.launches), "gate_wall_s": round(wall, 1), "outcome": decision.outcome,
               "reasons": decision.reasons, "stopped": result.stopped, "table": table(decision, cfg),
               "prediction_error": {lv: {n: r["error"] for n, r in row.get("configs", {}).items()}
                                    for lv, row in record["prediction"].items()},
               "policy": decision.policy,
               "launch_ready_s": [round(x.health_s or 0.0, 1) for x in result.launches]}  # fmt: skip
    (out / "rehearsal.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return summary


def table(decision: Any, cfg: GateConfig) -> dict[str, Any]:
    """Per config: throughput (output tok/s over the wall time) per level, the speedup over the
    baseline with its CI, and where it stops paying."""
    rows: dict[str, Any] = {}
    for s in decision.configs:
        rows[s.name] = {"crossover": s.crossover, "levels": {
            k: {"tok_s": lv.throughput_tok_s, "per_request_tok_s": lv.median_tok_s, "speedup": lv.speedup,
                "ci": [lv.ci_low, lv.ci_high], "accept_length": lv.accept_length, "cap": lv.max_running_requests}
            for k, lv in s.levels.items()}}  # fmt: skip
    return rows


def rejudge(folder: Path) -> dict[str, Any]:
    """A rehearsal that came back (its results.tar.gz, or the folder it unpacks to) judged again by
    the decision as it is now: the per-level table, the policy the sweep supports, the prediction
    per level and each launch's figures, from the records in its report.json."""
    import tarfile
    import tempfile

    from tasks.gate.records import BenchResult

    with tempfile.TemporaryDirectory() as tmp:
        root = folder
        if (folder / "results.tar.gz").exists():
            with tarfile.open(folder / "results.tar.gz") as tar:
                tar.extractall(tmp, filter="data")
            root = Path(tmp)
        report = json.loads((root / "run/gate/report.json").read_text())
    cfg = GateConfig(**report["gate_config"])
    result = BenchResult.from_dict(report["bench"])
    decision = decide(result, cfg)
    policy = build_policy(decision, cfg)
    steps = {int(k.split("-s")[1].split("-")[0]): v for k, v in cfg.simulated_acceptance.items() if "-k1-" in k}
    record = load_record(result, decision.configs, steps, float(cfg.max_new_tokens), cfg.deploy_level)
    return {"table": table(decision, cfg), "policy": policy.to_dict() if policy else None,
            "prediction_error": {lv: {n: r["error"] for n, r in row.get("configs", {}).items()}
                                 for lv, row in record["prediction"].items()}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--rejudge"]:
        print(json.dumps(rejudge(Path(argv[1])), indent=1, default=str))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--engine", choices=["sglang", "emulated"], default="sglang")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen15b")
    p.add_argument("--levels", default="1,2,4,8,16,32,64")
    p.add_argument("--accept", help="label=accept_length,... (default: the promoted Qwen2.5-Coder draft's)")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repetitions", type=int, default=1)
    p.add_argument("--reply-tokens", help="a JSON list of reply lengths, prompt i's the i-th (gate.simulated_reply_tokens)")
    p.add_argument("--sweep-only", action="store_true", help="no policy launch pair: the sweep and the policy it supports")
    summary = rehearse(p.parse_args(argv))
    for name, row in summary["table"].items():
        print(f"{name:<24}", " ".join(f"{k}:{(v['tok_s'] or 0):.0f}/{(v['speedup'] or 1):.2f}x" for k, v in row["levels"].items()))
    print(json.dumps({k: summary[k] for k in ("outcome", "launches", "gate_wall_s", "reasons")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
