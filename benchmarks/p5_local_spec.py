"""P5: the local speculative engine on one GPU; offline prediction (replay + cost model) vs measured.

    python3 benchmarks/p5_local_spec.py --json $OUT/p5.json          # H200: 1B-shaped target
    .venv/bin/python benchmarks/p5_local_spec.py --tiny              # CPU smoke of the same code

1. Target: random-weight Llama built from a config (default: Llama-3.2-1B's shape, bf16).
2. Its own greedy outputs on random-token prompts (batched, tasks.engines.local_decode),
   hidden states captured with tasks.engines.local_capture (output-of-layer aux ids).
3. A draft trained briefly with the project's training-time-test code (tasks.draft.ttt), then
   exported in SGLang's format and loaded back (tasks.draft.export).
4. Held-out prompts: baseline greedy with the engine; offline replay on those sequences
   (states from a full forward, as extraction stores them) gives accept lengths per num_steps.
5. For graphs on and off: per-step costs, baseline and speculative decode over the prompts,
   the cost model's prediction (overhead calibrated on the baseline run) against the measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tasks
from tasks.draft.config import DraftConfig
from tasks.draft.export import export_sglang, load_exported
from tasks.draft.model import Eagle3Draft
from tasks.draft.ttt import Batch, TTTModel, counted_rows, summarize
from tasks.draft.vocab import build_vocab_map, count_tokens
from tasks.engines.base import GenerationRequest, SamplingParams
from tasks.engines.local_capture import LocalCapture
from tasks.engines.local_decode import BatchDecoder
from tasks.engines.local_spec import SpecEngine
from tasks.engines.local_spec_bench import decode_benchmark, measure_step_costs

SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=2048, tie_word_embeddings=False),
}  # fmt: skip


def gate_modules() -> tuple[Any, Any]:
    """tasks.gate.replay and tasks.gate.cost_model. The package's __init__ (GateConfig) needs
    pydantic, which the GPU image lacks and these two modules do not: without pydantic the
    package is registered without running its __init__."""
    try:
        import pydantic  # noqa: F401
    except ImportError:
        package = types.ModuleType("tasks.gate")
        package.__path__ = [str(Path(tasks.__file__).parent / "gate")]
        sys.modules["tasks.gate"] = package
    from tasks.gate import cost_model, replay

    return replay, cost_model


def lr_multiplier(step: int, warmup: int, total: int) -> float:
    """tasks.draft.trainer's schedule (that module imports the pydantic config layer)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_target(shape: str, device: str, dtype: torch.dtype, seed: int, tied: bool) -> LlamaForCausalLM:
    """transformers' own random init (normal, std 0.02). Tied embeddings (Llama-3.2-1B's
    choice) make greedy replies repeat one token for long runs; untied ones give replies with
    no repeats in a 1B shape (measured on CPU): the two ends of how predictable a target is."""
    config = LlamaConfig(**{**SHAPES[shape], "tie_word_embeddings": tied}, max_position_embeddings=4096,
                         rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n, length), generator=g).tolist()


def batched_greedy(model, prompts: list[list[int]], max_new: int, batch: int) -> list[list[int]]:
    decoder = BatchDecoder(model, pad_id=0, eos_ids=frozenset())
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new)
    out = []
    for start in range(0, len(prompts), batch):
        reqs = [GenerationRequest(f"{start + i:012x}", "p", 0, tuple(p), greedy)
                for i, p in enumerate(prompts[start : start + batch])]  # fmt: skip
        out += [r.output_ids for r in decoder.decode(reqs)]
    return out


def train_draft_direct(model, ids, mask, aux, last, args, device) -> tuple[Eagle3Draft, dict[str, Any]]:
    """The trainer's recipe (AdamW, warm-up + cosine, grad clip, bf16 autocast, TTT loss) on
    in-memory tensors, bounded by steps and seconds."""
    target_cfg = model.config.to_dict()
    draft_cfg = DraftConfig.from_target(target_cfg, args.draft_vocab)
    vocab = build_vocab_map(count_tokens(zip(ids.cpu(), mask.cpu(), strict=True), draft_cfg.vocab_size),
                            draft_cfg.draft_vocab_size)  # fmt: skip
    head_dtype = torch.bfloat16 if device == "cuda" else torch.float32
    embed = model.get_input_embeddings().weight.detach().to(head_dtype)
    lm_head = model.get_output_embeddings().weight.detach().to(head_dtype)
    torch.manual_seed(0)
    draft = Eagle3Draft(draft_cfg, embed)
    draft.set_vocab(vocab.d2t, vocab.t2d)
    ttt = TTTModel(draft, lm_head, vocab.draft_ids).to(device)
    params = [p for p in ttt.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), fused=device == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, 20, args.train_steps))
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
    n, t = ids.shape
    g = torch.Generator().manual_seed(0)
    began, step, history = time.perf_counter(), 0, []
    while step < args.train_steps and time.perf_counter() - began < args.train_seconds:
        order = torch.randperm(n, generator=g)
        for start in range(0, n - args.batch + 1, args.batch):
            idx = order[start : start + args.batch].to(ids.device)
            batch = Batch(ids[idx], mask[idx], aux[idx], last[idx], torch.full((args.batch,), t))
            rows = counted_rows(batch.loss_mask, args.ttt_steps, torch.device(device))
            with autocast:
                loss, stats = ttt(batch.to(device, head_dtype), rows, args.ttt_steps, 0.8, 2048)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 50 == 0 or step == 1:
                s = summarize(stats, 0.8)
                history.append({"step": step, "loss": s["loss"], "acc_0": s["acc_0"], "sim_accept_len": s["sim_accept_len"],
                                "elapsed_s": time.perf_counter() - began})  # fmt: skip
                log(f"train step {step}: loss {s['loss']:.3f} acc_0 {s['acc_0']:.3f} sim_accept_len {s['sim_accept_len']:.3f}")
            if step >= args.train_steps or time.perf_counter() - began >= args.train_seconds:
                break
    info = {"steps": step, "seconds": time.perf_counter() - began, "history": history,
            "draft_vocab": draft_cfg.draft_vocab_size, "vocab_stats": vocab.stats}  # fmt: skip
    return draft.eval(), info


def compare(pred: dict[str, Any], bench: dict[str, Any], steps: list[int]) -> list[dict[str, Any]]:
    rows = [{"config": "baseline", "predicted_tok_s": pred["baseline_tok_s"],
             "measured_tok_s": bench["baseline"]["tok_s"]}]  # fmt: skip
    for k in steps:
        m = bench[f"spec_k{k}"]
        p = pred["per_steps"][str(k)]
        rows.append({"config": f"spec_k{k}", "predicted_tok_s": p["tok_s"], "measured_tok_s": m["tok_s"],
                     "replay_accept": p["accept_length"], "measured_accept": m["accept_length"],
                     "break_even_accept": p["break_even_accept_length"], "exact_match": m["exact_match"]})  # fmt: skip
    for r in rows:
        r["error"] = r["predicted_tok_s"] / r["measured_tok_s"] - 1.0 if r["measured_tok_s"] else None
    return rows


def run_target(tied, args, device, dtype, steps, replay_mod, cost_mod, entry, save, deadline) -> None:
    """Build, generate, train, export, then measure with graphs on and off, into `entry`."""
    shape = "tiny" if args.tiny else "1b"
    model = build_target(shape, device, dtype, seed=0, tied=tied)
    vocab = model.config.vocab_size
    aux_ids = DraftConfig.from_target(model.config.to_dict(), 2).aux_layer_ids
    entry["target"] = {"shape": shape, **SHAPES[shape], "tie_word_embeddings": tied, "dtype": str(dtype),
                       "aux_layer_ids": aux_ids}  # fmt: skip
    log(f"target built: {shape}, tied={tied}, on {device}")

    t0 = time.perf_counter()
    train_prompts = random_prompts(args.train_seqs, args.prompt_len, vocab, seed=1)
    outputs = batched_greedy(model, train_prompts, args.max_new, batch=64)
    seqs = [p + o for p, o in zip(train_prompts, outputs, strict=True)]
    states = LocalCapture(model, aux_ids, batch_size=16).capture(seqs)
    ids = torch.tensor(seqs, device=device)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, args.prompt_len :] = True
    aux = torch.stack([s.aux for s in states])
    last = torch.stack([s.last for s in states])
    del states
    distinct = [len(set(o)) for o in outputs]
    entry["data"] = {"train_seqs": len(seqs), "tokens_per_seq": ids.shape[1], "seconds": time.perf_counter() - t0,
                     "distinct_tokens_per_reply_mean": sum(distinct) / len(distinct),
                     "example_reply_head": outputs[0][:16]}  # fmt: skip
    log(f"data: {entry['data']}")

    draft, entry["train"] = train_draft_direct(model, ids, mask, aux, last, args, device)
    del aux, last, ids, mask
    with tempfile.TemporaryDirectory() as tmp:
        export_sglang(draft.float().cpu(), f"{tmp}/draft")
        draft = load_exported(f"{tmp}/draft", model.get_input_embeddings().weight.detach().float().cpu())
    draft = draft.to(device, dtype).eval()
    log(f"draft trained ({entry['train']['steps']} steps) and loaded back from its SGLang export")
    save()

    eval_prompts = random_prompts(args.eval_prompts, args.prompt_len, vocab, seed=2)
    max_len = args.prompt_len + args.max_new + max(steps) + 64
    results: dict[str, Any] = {}
    entry["results"] = results
    for graphs in ([True, False] if device == "cuda" else [False]):
        mode = "cuda_graphs" if graphs else "eager"
        if time.perf_counter() > deadline:
            entry.setdefault("skipped", []).append(mode)
            continue
        engine = SpecEngine(model, draft, eos_ids=set(), max_len=max_len, use_cuda_graphs=graphs)
        prompts = eval_prompts if graphs or device != "cuda" else eval_prompts[: args.eager_prompts]
        costs = measure_step_costs(engine, steps, iters=100 if graphs else 20, position=args.prompt_len + 64)
        bench = decode_benchmark(engine, prompts, args.max_new, steps)
        raw = bench.pop("results")
        del engine
        if "replay" not in entry:
            base = raw["baseline"]
            capture = LocalCapture(model, aux_ids, batch_size=8).capture([p + r.output_ids for p, r in zip(prompts, base, strict=True)])
            rseqs = [SimpleNamespace(sequence_id=str(i), domain="random", input_ids=torch.tensor(p + r.output_ids),
                                     loss_mask=torch.tensor([False] * len(p) + [True] * len(r.output_ids)), aux_hidden=c.aux)
                     for i, (p, r, c) in enumerate(zip(prompts, base, capture, strict=True))]  # fmt: skip
            rep = replay_mod.replay(draft, rseqs, steps, n_bootstrap=1000)
            entry["replay"] = rep.to_dict()
            per_seq = {r.sequence_id: r for r in rep.sequences}
            entry["replay_vs_engine_cycles_equal"] = {
                f"k{k}": sum(per_seq[str(i)].emitted[k] == s.emitted for i, s in enumerate(raw[f"spec_k{k}"])) / len(prompts)
                for k in steps
            }  # fmt: skip
        accept = {int(k): v["accept_length"] for k, v in entry["replay"]["overall"].items()}
        calibrated = cost_mod.calibrate_overhead(cost_mod.StepCosts.from_dict(costs), bench["baseline"]["tok_s"])
        prediction = cost_mod.predict(calibrated, accept).to_dict()
        measured_accept = {k: bench[f"spec_k{k}"]["accept_length"] for k in steps}
        results[mode] = {
            "raw_costs": costs, "costs": calibrated.to_dict(), "bench": bench, "prediction": prediction,
            "prediction_with_measured_accept": cost_mod.predict(calibrated, measured_accept).to_dict(),
            "compare": compare(prediction, bench, steps),
        }  # fmt: skip
        log(f"{mode}: " + json.dumps(results[mode]["compare"], default=str))
        save()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shape on CPU, few sequences (smoke)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--train-seqs", type=int, default=256)
    ap.add_argument("--eval-prompts", type=int, default=12)
    ap.add_argument("--eager-prompts", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--train-steps", type=int, default=600)
    ap.add_argument("--train-seconds", type=float, default=40.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--ttt-steps", type=int, default=5)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--num-steps", default="1,2,3,4,5")
    ap.add_argument("--targets", default="tied,untied", help="which random targets, in order")
    ap.add_argument("--budget-seconds", type=float, default=240.0, help="skip phases that would start later")
    args = ap.parse_args(argv)
    if args.tiny:
        args.train_seqs, args.eval_prompts, args.eager_prompts, args.max_new = 48, 6, 4, 24
        args.train_steps, args.batch, args.draft_vocab, args.lr = 30, 8, 1024, 3e-3
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    steps = [int(s) for s in args.num_steps.split(",")]
    out: dict[str, Any] = {"args": vars(args), "device": device, "torch": torch.__version__,
                           "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "errors": []}  # fmt: skip

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2, default=str)

    replay_mod, cost_mod = gate_modules()
    deadline = time.perf_counter() + args.budget_seconds
    for tied in [t == "tied" for t in args.targets.split(",")]:
        name = "tied" if tied else "untied"
        entry: dict[str, Any] = {}
        out.setdefault("targets", {})[name] = entry
        if time.perf_counter() > deadline:
            entry["skipped"] = "time budget spent"
            continue
        try:
            run_target(tied, args, device, dtype, steps, replay_mod, cost_mod, entry, save, deadline)
        except Exception as e:  # keep what was measured; report the failure
            out["errors"].append(f"{name}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            log(f"{name} FAILED: {e}")
        save()
        if device == "cuda":
            torch.cuda.empty_cache()

    print("\n| target | mode | config | predicted tok/s | measured tok/s | error | replay accept | measured accept | exact match |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, entry in out.get("targets", {}).items():
        for mode, r in entry.get("results", {}).items():
            for c in r["compare"]:
                err = "-" if c["error"] is None else f"{c['error']:+.1%}"
                print(f"| {name} | {mode} | {c['config']} | {c['predicted_tok_s']:.1f} | {c['measured_tok_s']:.1f} | {err} | "
                      f"{c.get('replay_accept', 1.0):.3f} | {c.get('measured_accept') or 1.0:.3f} | {c.get('exact_match', '-')} |")
    save()
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
