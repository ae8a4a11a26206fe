"""P4: one EAGLE-3 training step, ours vs SpecForge 0.2.0's, on one GPU.

Same seeded random data for every part at Llama-3.1-8B draft dims (DIMS), one sequence, TTT 7,
bf16; each part a full optimizer step: ours `tasks.draft.trainer.train_step` (eager and compiled),
SpecForge's `LlamaForCausalLMEagle3` + `OnlineEagle3Model` with its BF16Optimizer (flex_attention
and sdpa; teacher from hidden states or from full target logits). MFU counts the same model FLOPs
for both (model_flops) over PEAK_FLOPS. Set-up and figures: BENCHMARKS.md, P4.

    python benchmarks/p4_train_step.py --out-dir OUT            # every part, one process each
    python benchmarks/p4_train_step.py --part ours --compile 1  # one part, prints one JSON line
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

DIMS = {  # hidden, intermediate, heads, kv heads, head dim, vocab, draft vocab
    "8b": (4096, 14336, 32, 8, 128, 128256, 32000),
    "tiny": (64, 128, 4, 2, 16, 512, 128),  # a CPU smoke test of the harness
}
H, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB, DRAFT_VOCAB = DIMS["8b"]
PEAK_FLOPS = 989.4e12  # dense bf16, the H100 SXM figure (KINDS.md measured 790 on random 8k matmuls)
PARTS = [  # most important first: a part that runs out of time only loses what follows
    ("check", []),
    ("ours", ["--compile", "1"]),
    ("specforge", ["--backend", "flex_attention", "--teacher", "logits"]),
    ("ours", ["--compile", "0"]),
    ("specforge", ["--backend", "sdpa", "--teacher", "logits"]),
    ("specforge", ["--backend", "flex_attention", "--teacher", "compact"]),
]


def model_flops(tokens: int, seq: int, ttt: int) -> float:
    """`ttt` unroll steps of the draft layer + lm_head and causal attention (backward = 2x forward),
    fc (forward + weight gradient) and the teacher's draft-vocabulary logits."""
    per_step_params = 2 * H * HEADS * HEAD_DIM + 2 * 2 * H * KV_HEADS * HEAD_DIM + H * H \
        + 3 * H * INTER + H * DRAFT_VOCAB
    layer = 3 * 2 * per_step_params * tokens * ttt
    attention = 3 * 2 * 2 * (seq / 2) * HEADS * HEAD_DIM * tokens * ttt
    fc = 2 * 2 * 3 * H * H * tokens
    teacher = 2 * H * DRAFT_VOCAB * tokens
    return layer + attention + fc + teacher


def random_inputs(seq: int, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """The same tensors for every part (drawn on `device` by a seeded generator)."""
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=g, device=device) * std).to(dtype)

    return {
        "input_ids": torch.randint(0, VOCAB, (1, seq), generator=g, device=device),
        "loss_mask": torch.ones(1, seq, dtype=torch.bool),
        "aux": randn(1, seq, 3 * H),
        "last": randn(1, seq, H),
        "embed": randn(VOCAB, H, std=0.02),
        "lm_head": randn(VOCAB, H, std=0.02),
        "draft_ids": torch.randperm(VOCAB, generator=g, device=device)[:DRAFT_VOCAB].sort().values,
    }


def time_steps(step, warmup: int, steps: int, profile: Path | None = None) -> dict[str, float]:
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    for _ in range(warmup):
        step()
    sync()
    warm_s = time.perf_counter() - began
    began = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    out = {"ms_per_step": (time.perf_counter() - began) * 1e3 / steps, "warmup_s": warm_s,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0}
    if profile is not None:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with torch_profile(activities=activities) as prof:
            step()
            sync()
        key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        profile.write_text(prof.key_averages().table(sort_by=key, row_limit=40))
    return out


def run_ours(args: argparse.Namespace) -> dict[str, Any]:
    from tasks.config import TrainConfig
    from tasks.draft.architecture import DraftConfig
    from tasks.draft.model import Eagle3Draft
    from tasks.draft.trainer import build_optimizer, train_step
    from tasks.draft.ttt import Batch, TTTModel

    data = random_inputs(args.seq, args.device)
    device = torch.device(args.device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    cfg = TrainConfig(ttt_steps=args.ttt, ttt_decay=0.8, max_grad_norm=0.5, warmup_steps=0,
                      logits_chunk=args.logits_chunk, device=args.device, compute_dtype=dtype)
    draft_cfg = DraftConfig(
        hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None, max_position_embeddings=131072, vocab_size=VOCAB,
        draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=[1, 15, 28], target_hidden_size=H, target_num_layers=32)  # fmt: skip
    torch.manual_seed(0)
    with device:
        draft = Eagle3Draft(draft_cfg, data["embed"])
        ids = data["draft_ids"]
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[ids] = True
        draft.set_vocab(ids - torch.arange(DRAFT_VOCAB), t2d)
    model = TTTModel(draft, data["lm_head"], ids, compile_kernels=bool(args.compile)).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = build_optimizer(params, cfg, 10**6, device)
    # Data already on the GPU, as for SpecForge below; the mask stays on the host (pinned),
    # where the trainer reads the counted positions from.
    mask = data["loss_mask"].pin_memory() if device.type == "cuda" else data["loss_mask"]
    batch = Batch(data["input_ids"], mask, data["aux"], data["last"], torch.tensor([args.seq]))
    losses = []

    def step() -> None:
        stats, _ = train_step(model, batch, cfg, device, getattr(torch, dtype), params,
                              optimizer, scheduler)
        losses.append(stats.loss_sum)

    profile = Path(args.profile_dir) / f"profile_ours_{args.compile}.txt" if args.profile_dir else None
    out = time_steps(step, args.warmup, args.steps, profile)
    out["first_loss_sum_step0"] = float(losses[0][0])
    return out


def run_specforge(args: argparse.Namespace) -> dict[str, Any]:
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.optimizer import BF16Optimizer
    from specforge.utils import padding
    from transformers import LlamaConfig

    data = random_inputs(args.seq, args.device)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    config = LlamaConfig(
        hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072, vocab_size=VOCAB, hidden_act="silu",
        num_hidden_layers=1, tie_word_embeddings=False, pretraining_tp=1)  # fmt: skip
    config.draft_vocab_size = DRAFT_VOCAB
    torch.manual_seed(0)
    with dev:
        draft = LlamaForCausalLMEagle3(config, attention_backend=args.backend).to(dev, dtype)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(data["embed"])
        ids = data["draft_ids"].to(dev)
        draft.t2d.zero_()
        draft.t2d[ids] = True
        draft.d2t.copy_(ids - torch.arange(DRAFT_VOCAB, device=dev))
    draft.embed_tokens.weight.requires_grad_(False)
    model = OnlineEagle3Model(draft, length=args.ttt, attention_backend=args.backend)
    optimizer = BF16Optimizer(draft, lr=1e-4, max_grad_norm=0.5)
    lm_head = data["lm_head"].to(dev, dtype)
    input_ids = padding(data["input_ids"].to(dev), left=False)
    last = padding(data["last"].to(dev, dtype), left=False)
    loss_mask = data["loss_mask"].to(dev).long()[..., None]
    attention_mask = torch.ones(1, args.seq, dtype=torch.long, device=dev)
    aux = data["aux"].to(dev, dtype)

    def step() -> None:
        if args.teacher == "compact":
            kwargs = {"target": None, "target_hidden_for_compact": last,
                      "target_head_weight": lm_head}
        else:
            kwargs = {"target": last @ lm_head.T}
        plosses, *_ = model(input_ids=input_ids, attention_mask=attention_mask,
                            loss_mask=loss_mask, hidden_states=aux, **kwargs)
        loss = sum(0.8**i * p for i, p in enumerate(plosses))
        loss.backward()
        optimizer.step()

    name = f"profile_specforge_{args.backend}_{args.teacher}.txt"
    profile = Path(args.profile_dir) / name if args.profile_dir else None
    return time_steps(step, args.warmup, args.steps, profile)


def run_check(args: argparse.Namespace) -> dict[str, Any]:
    """On the GPU: flash TTT attention vs the masked-softmax path (fp32 reference)."""
    from tasks.draft.ttt_attention import TTTAttention

    torch.manual_seed(0)
    dev = torch.device("cuda")

    def run(dtype: torch.dtype, flash: bool):
        g = torch.Generator(device=dev).manual_seed(1)
        shapes = [(2, 8, 300, 128), (2, 2, 300, 128), (2, 2, 300, 128)]
        leaves = [[torch.randn(s, generator=g, device=dev).to(dtype).requires_grad_()
                   for s in shapes] for _ in range(4)]
        attend = TTTAttention(4, use_flash=flash)
        outs = [attend(*qkv) for qkv in leaves]
        sum((o.float() * (i + 1)).pow(2).sum() for i, o in enumerate(outs)).backward()
        return outs, [x.grad for qkv in leaves for x in qkv]

    ref_out, ref_grad = run(torch.float32, False)
    out, grad = run(torch.bfloat16, True)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm())

    return {"flash_out_rel_err": max(rel(a, b) for a, b in zip(out, ref_out, strict=True)),
            "flash_grad_rel_err": max(rel(a, b) for a, b in zip(grad, ref_grad, strict=True))}


def one_part(args: argparse.Namespace) -> dict[str, Any]:
    global H, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB, DRAFT_VOCAB
    H, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB, DRAFT_VOCAB = DIMS[args.dims]
    tokens = args.seq
    if args.part == "check":
        return {"part": "check", **run_check(args)}
    result = run_ours(args) if args.part == "ours" else run_specforge(args)
    name = (f"ours{' compiled' if args.compile else ' eager'}" if args.part == "ours"
            else f"specforge {args.backend} {args.teacher}")
    flops = model_flops(tokens, args.seq, args.ttt)
    seconds = result["ms_per_step"] / 1e3
    return {"part": name, "tok_per_s": tokens / seconds, "mfu": flops / seconds / PEAK_FLOPS,
            "model_tflop_per_step": flops / 1e12, **result}


def drive(args: argparse.Namespace) -> int:
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if torch.cuda.is_available():
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    results = []
    for part, extra in PARTS:
        cmd = [sys.executable, __file__, "--part", part, "--seq", str(args.seq),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--dims", args.dims,
               "--device", args.device, "--profile-dir", str(out_dir), *extra]
        began = time.time()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.part_timeout,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            row = json.loads(lines[-1]) if proc.returncode == 0 and lines else {
                "part": f"{part} {' '.join(extra)}", "error": proc.stderr[-1500:]}
        except subprocess.TimeoutExpired:
            row = {"part": f"{part} {' '.join(extra)}", "error": f"timeout {args.part_timeout}s"}
        row["wall_s"] = round(time.time() - began, 1)
        results.append(row)
        print(json.dumps(row), flush=True)
        (out_dir / "p4_results.json").write_text(json.dumps(results, indent=2))
    timed = [r for r in results if "tok_per_s" in r]
    ours = max((r for r in timed if r["part"].startswith("ours")), key=lambda r: r["tok_per_s"],
               default=None)
    theirs = max((r for r in timed if r["part"].startswith("specforge")),
                 key=lambda r: r["tok_per_s"], default=None)
    if ours and theirs:
        print(f"best ours {ours['part']}: {ours['tok_per_s']:.0f} tok/s; best SpecForge "
              f"{theirs['part']}: {theirs['tok_per_s']:.0f} tok/s; ratio "
              f"{ours['tok_per_s'] / theirs['tok_per_s']:.3f} (goal >= 1.2)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["check", "ours", "specforge"])
    parser.add_argument("--compile", type=int, default=0)
    parser.add_argument("--backend", default="flex_attention", choices=["flex_attention", "sdpa"])
    parser.add_argument("--teacher", default="compact", choices=["compact", "logits"])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--ttt", type=int, default=7)
    parser.add_argument("--logits-chunk", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--part-timeout", type=int, default=150)
    parser.add_argument("--out-dir", default="benchmarks/out")
    parser.add_argument("--profile-dir", default="", help="write a kernel table per part here")
    parser.add_argument("--dims", default="8b", choices=sorted(DIMS))
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.part is None:
        return drive(args)
    print(json.dumps(one_part(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
