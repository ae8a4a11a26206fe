"""P5: the local speculative engine on one GPU; offline prediction (replay + cost model) vs measured.

    python3 benchmarks/p5_local_spec.py --json $OUT/p5.json          # H200: 1B-shaped target
    .venv/bin/python benchmarks/p5_local_spec.py --tiny              # CPU smoke of the same code

run_target's steps: the learnable random target (p5_target; --alpha auto picks alpha by a sweep),
its greedy replies captured, a draft trained with the project's TTT code (--lr auto: short probes)
and loaded back from its SGLang export, then per mode (graphs on and off) the cost model's
prediction, calibrated on the baseline, against the measured decode. Set-up and figures:
BENCHMARKS.md, P5.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace
from typing import Any

import torch
from p5_target import SHAPES, SuccessorTarget, build_target, successor_agreement

from tasks.draft.architecture import DraftConfig
from tasks.draft.export import export_sglang, load_exported
from tasks.draft.model import Eagle3Draft
from tasks.draft.ttt import Batch, TTTModel, counted_rows, summarize
from tasks.draft.vocab import build_vocab_map, count_tokens
from tasks.engines.base import GenerationRequest, SamplingParams
from tasks.engines.local_decode import BatchDecoder
from tasks.extract.local_capture import LocalCapture
from tasks.gate import cost_model, replay
from tasks.gate.spec_engine import SpecEngine
from tasks.gate.spec_engine_measure import decode_benchmark, measure_step_costs


def lr_multiplier(step: int, warmup: int, total: int) -> float:
    """tasks.draft.trainer's schedule (that module imports the pydantic config layer)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


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


def train_draft_direct(model, ids, mask, aux, last, args, device, lr: float, max_steps: int,
                       max_seconds: float) -> tuple[Eagle3Draft, dict[str, Any]]:  # fmt: skip
    """The trainer's recipe (AdamW without weight decay, warm-up + cosine, grad clip, bf16
    autocast, TTT loss) on in-memory tensors, bounded by steps and seconds."""
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
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0, fused=device == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, 20, max_steps))
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
    n, t = ids.shape
    g = torch.Generator().manual_seed(0)
    began, step, history = time.perf_counter(), 0, []
    while step < max_steps and time.perf_counter() - began < max_seconds:
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
            if step % 50 == 0 or step == 1 or step == max_steps:
                s = summarize(stats, 0.8)
                history.append({"step": step, "loss": s["loss"], "acc_0": s["acc_0"], "sim_accept_len": s["sim_accept_len"],
                                "elapsed_s": time.perf_counter() - began})  # fmt: skip
                log(f"train step {step}: loss {s['loss']:.3f} acc_0 {s['acc_0']:.3f} sim_accept_len {s['sim_accept_len']:.3f}")
            if step >= max_steps or time.perf_counter() - began >= max_seconds:
                break
    info = {"lr": lr, "steps": step, "seconds": time.perf_counter() - began, "history": history,
            "draft_vocab": draft_cfg.draft_vocab_size, "vocab_stats": vocab.stats}  # fmt: skip
    return draft.eval(), info


def pick_alpha(target: SuccessorTarget, args, entry: dict[str, Any]) -> float:
    """The alpha to use: given, or (auto) the grid value whose greedy replies follow the
    successor map closest to --target-agreement, measured on prompts the run uses nowhere else."""
    grid = [float(a) for a in args.alpha_grid.split(",")] if args.alpha == "auto" else [float(args.alpha)]
    prompts = random_prompts(args.sweep_prompts, args.prompt_len, target.model.config.vocab_size, seed=3)
    sweep, kept = [], {}
    for alpha in grid:
        target.set_alpha(alpha)
        began = time.perf_counter()
        replies = batched_greedy(target.model, prompts, args.sweep_new, batch=args.sweep_prompts)
        kept[alpha] = [p + r for p, r in zip(prompts[:8], replies, strict=False)]
        sweep.append({"alpha": alpha, **successor_agreement(target.succ, replies), "seconds": time.perf_counter() - began})
        log(f"alpha sweep: {sweep[-1]}")
    entry["alpha_sweep"] = sweep
    best = min(sweep, key=lambda r: (abs(r["agreement"] - args.target_agreement), r["alpha"]))
    target.set_alpha(best["alpha"])
    entry["sharpen"] = target.sharpen(kept[best["alpha"]], args.prompt_len, args.teacher_top1)
    log(f"lm_head sharpened: {entry['sharpen']}")
    return best["alpha"]


def pick_lr(model, ids, mask, aux, last, args, device, entry: dict[str, Any]) -> float:
    """The learning rate: given, or (auto) the grid value whose short probe run (fresh draft,
    --probe-steps) ends with the highest simulated accept length on its training batches."""
    if args.lr != "auto":
        return float(args.lr)
    probes = []
    for lr in [float(x) for x in args.lr_grid.split(",")]:
        _, info = train_draft_direct(model, ids, mask, aux, last, args, device, lr, args.probe_steps, 1e9)
        probes.append({"lr": lr, "steps": info["steps"], "last": info["history"][-1]})
        log(f"lr probe: {probes[-1]}")
    entry["lr_probes"] = probes
    return max(probes, key=lambda p: p["last"]["sim_accept_len"])["lr"]


def run_target(args, device, dtype, steps, entry, save, deadline) -> None:
    """Build, tune alpha, generate, train, export, then measure with graphs on and off, into `entry`."""
    shape = "tiny" if args.tiny else "1b"
    target = build_target(shape, device, dtype, seed=0, subset=args.subset, alpha=1.0)
    model = target.model
    vocab = model.config.vocab_size
    aux_ids = DraftConfig.from_target(model.config.to_dict(), 2).aux_layer_ids
    log(f"target built: {shape}, successor subset {args.subset}, on {device}")
    alpha = pick_alpha(target, args, entry)
    entry["target"] = {"shape": shape, **SHAPES[shape], **target.describe(), "dtype": str(dtype), "aux_layer_ids": aux_ids}
    log(f"alpha = {alpha}")
    if args.sweep_only:
        return

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
    entry["data"] = {"train_seqs": len(seqs), "tokens_per_seq": ids.shape[1], "seconds": time.perf_counter() - t0,
                     **successor_agreement(target.succ, outputs), "example_reply_head": outputs[0][:16]}  # fmt: skip
    log(f"data: {entry['data']}")

    lr = pick_lr(model, ids, mask, aux, last, args, device, entry)
    draft, entry["train"] = train_draft_direct(model, ids, mask, aux, last, args, device, lr, args.train_steps,
                                               args.train_seconds)  # fmt: skip
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
        synced = measure_step_costs(engine, steps, iters=100 if graphs else 20, position=args.prompt_len + 64, synced=True)
        bench = decode_benchmark(engine, prompts, args.max_new, steps)
        raw = bench.pop("results")
        del engine
        # Replay on exactly this mode's prompts, so its accept length and the engine's are comparable.
        base = raw["baseline"]
        capture = LocalCapture(model, aux_ids, batch_size=8).capture([p + r.output_ids for p, r in zip(prompts, base, strict=True)])
        rseqs = [SimpleNamespace(sequence_id=str(i), domain="random", input_ids=torch.tensor(p + r.output_ids),
                                 loss_mask=torch.tensor([False] * len(p) + [True] * len(r.output_ids)), aux_hidden=c.aux)
                 for i, (p, r, c) in enumerate(zip(prompts, base, capture, strict=True))]  # fmt: skip
        rep = replay.replay(draft, rseqs, steps, n_bootstrap=1000)
        per_seq = {r.sequence_id: r for r in rep.sequences}
        cycles_equal = {
            f"k{k}": sum(per_seq[str(i)].emitted[k] == s.emitted for i, s in enumerate(raw[f"spec_k{k}"])) / len(prompts)
            for k in steps
        }  # fmt: skip
        accept = {int(k): v["accept_length"] for k, v in rep.to_dict()["overall"].items()}
        calibrated = cost_model.calibrate_overhead(cost_model.StepCosts.from_dict(costs), bench["baseline"]["tok_s"])
        prediction = cost_model.predict(calibrated, accept).to_dict()
        synced_calibrated = cost_model.calibrate_overhead(cost_model.StepCosts.from_dict(synced), bench["baseline"]["tok_s"])
        measured_accept = {k: bench[f"spec_k{k}"]["accept_length"] for k in steps}
        results[mode] = {
            "raw_costs": costs, "costs": calibrated.to_dict(), "bench": bench, "prediction": prediction,
            "prediction_with_measured_accept": cost_model.predict(calibrated, measured_accept).to_dict(),
            "synced_costs": synced_calibrated.to_dict(),
            "synced_compare": compare(cost_model.predict(synced_calibrated, accept).to_dict(), bench, steps),
            "replay": rep.to_dict(), "replay_vs_engine_cycles_equal": cycles_equal,
            "baseline_successor_agreement": successor_agreement(target.succ, [r.output_ids for r in base]),
            "compare": compare(prediction, bench, steps),
        }  # fmt: skip
        log(f"{mode}: " + json.dumps(results[mode]["compare"], default=str) + f" cycles equal {cycles_equal}")
        save()


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


def print_table(results: dict[str, Any]) -> None:
    print("\n| mode | config | predicted tok/s | measured tok/s | error | error, synced costs | replay accept | measured accept | outputs = baseline |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        n = r["bench"]["baseline"]["requests"]
        for c, sc in zip(r["compare"], r["synced_compare"], strict=True):
            base = c["config"] == "baseline"
            err = "(calibration) | (calibration)" if base else f"{c['error']:+.1%} | {sc['error']:+.1%}"
            match = f"{round(c['exact_match'] * n)}/{n}" if "exact_match" in c else "-"
            replay_a = f"{c['replay_accept']:.3f}" if "replay_accept" in c else "-"
            measured_a = f"{c['measured_accept']:.3f}" if "measured_accept" in c else "-"
            print(f"| {mode} | {c['config']} | {c['predicted_tok_s']:.1f} | {c['measured_tok_s']:.1f} | {err} | "
                  f"{replay_a} | {measured_a} | {match} |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shape on CPU, few sequences (smoke)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--subset", type=int, default=2048, help="tokens in the target's successor map")
    ap.add_argument("--alpha", default="auto", help="o_proj/down_proj scale, or 'auto' (sweep --alpha-grid)")
    ap.add_argument("--alpha-grid", default="0.04,0.045,0.05,0.055,0.06,0.065,0.07,0.075,0.08")
    ap.add_argument("--target-agreement", type=float, default=0.8)
    ap.add_argument("--teacher-top1", type=float, default=0.7, help="mean top-1 probability lm_head is sharpened to")
    ap.add_argument("--sweep-prompts", type=int, default=32)
    ap.add_argument("--sweep-new", type=int, default=64)
    ap.add_argument("--sweep-only", action="store_true", help="stop after the alpha sweep")
    ap.add_argument("--train-seqs", type=int, default=256)
    ap.add_argument("--eval-prompts", type=int, default=12)
    ap.add_argument("--eager-prompts", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--train-steps", type=int, default=900)
    ap.add_argument("--train-seconds", type=float, default=60.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", default="auto", help="AdamW learning rate, or 'auto' (probe --lr-grid)")
    ap.add_argument("--lr-grid", default="1e-4,3e-4,1e-3")
    ap.add_argument("--probe-steps", type=int, default=150)
    ap.add_argument("--ttt-steps", type=int, default=5)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--num-steps", default="1,2,3,4,5")
    ap.add_argument("--budget-seconds", type=float, default=420.0, help="skip measurement modes that would start later")
    args = ap.parse_args(argv)
    if args.tiny:  # smaller defaults; values given on the command line stay
        tiny = dict(train_seqs=48, eval_prompts=6, eager_prompts=4, max_new=24, train_steps=30, batch=8,
                    draft_vocab=1024, lr_grid="1e-3,3e-3", probe_steps=10, subset=64, sweep_prompts=8, sweep_new=24, alpha_grid="0.5,1.0,1.5")  # fmt: skip
        for name, value in tiny.items():
            if getattr(args, name) == ap.get_default(name):
                setattr(args, name, value)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    steps = [int(s) for s in args.num_steps.split(",")]
    out: dict[str, Any] = {"args": vars(args), "device": device, "torch": torch.__version__,
                           "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "errors": []}  # fmt: skip

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2, default=str)

    entry: dict[str, Any] = {}
    out["run"] = entry
    try:
        run_target(args, device, dtype, steps, entry, save, time.perf_counter() + args.budget_seconds)
    except Exception as e:  # keep what was measured; report the failure
        out["errors"].append(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        log(f"FAILED: {e}")
    save()

    print_table(entry.get("results", {}))
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
