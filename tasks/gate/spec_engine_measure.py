"""Measurements on the local speculative engine: per-step costs (the cost model's input) and
end-to-end decode speed, acceptance and output agreement over a prompt set."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tasks.gate.spec_engine import DecodeResult, SpecEngine


@torch.inference_mode()
def measure_step_costs(
    engine: SpecEngine, num_steps: Sequence[int], iters: int = 50, position: int = 256, synced: bool = False
) -> dict[str, Any]:
    """Mean seconds of one baseline step, one verify of k+1 tokens and one draft cycle
    (extend over k+1 rows + rollout of k), each timed alone over `iters` runs after three
    warm-up runs, at a mid-sequence `position` (attention reads the whole static cache, so the
    cost does not depend on it). Returns the cost model's dict (tasks.gate.cost_model).

    `synced` syncs after every run: a decode cycle reads its result back once, so host launches
    and device work do not overlap across cycles; where the host is the bottleneck (eager CUDA)
    that, not the pipelined timing, is what one cycle costs alone."""
    if position + max(num_steps, default=0) + 2 >= engine.target.max_len:
        position = engine.target.max_len // 2

    def timed(run: Callable[[], None], reset: Callable[[], None]) -> float:
        for _ in range(3):
            reset()
            run()
        engine.sync()
        if synced:
            total = 0.0
            for _ in range(iters):
                reset()
                engine.sync()
                began = time.perf_counter()
                run()
                engine.sync()
                total += time.perf_counter() - began
            return total / iters
        began = time.perf_counter()
        for _ in range(iters):
            reset()
            run()
        engine.sync()
        return (time.perf_counter() - began) / iters

    costs: dict[str, Any] = {
        "baseline_step_s": timed(engine.baseline_step(), lambda: engine.base_pos.fill_(position)),
        "verify_s": {},
        "draft_cycle_s": {},
        "source": "local_spec synced" if synced else "local_spec",
        "cuda_graphs": engine.use_cuda_graphs,
        "device": str(engine.device),
    }
    for k in num_steps:
        bufs = engine.cycle_buffers(k)

        def reset(b: Any = bufs, k: int = k) -> None:
            b.pos.copy_(engine.offsets[: k + 1] + position)
            b.n.zero_()

        costs["verify_s"][str(k + 1)] = timed(bufs.verify, reset)
        costs["draft_cycle_s"][str(k)] = timed(bufs.draft, reset)
    return costs


def summarize_runs(results: list[DecodeResult], reference: list[DecodeResult] | None = None) -> dict[str, Any]:
    """Decode tok/s (tokens after the first / decode seconds, summed over requests), accept
    length, and agreement with reference outputs (exact matches, first differing index)."""
    tokens = sum(r.decode_tokens for r in results)
    seconds = sum(r.decode_s for r in results)
    verifies = sum(r.verify_steps for r in results)
    out: dict[str, Any] = {
        "requests": len(results),
        "completion_tokens": sum(len(r.output_ids) for r in results),
        "decode_tokens": tokens,
        "decode_s": seconds,
        "prefill_s": sum(r.prefill_s for r in results),
        "tok_s": tokens / seconds if seconds > 0 else None,
        "verify_steps": verifies,
        "accept_length": tokens / verifies if verifies else None,
    }
    if reference is not None:
        exact, first = 0, []
        for r, ref in zip(results, reference, strict=True):
            diff = next((i for i, (a, b) in enumerate(zip(r.output_ids, ref.output_ids, strict=False)) if a != b), None)
            if diff is None and len(r.output_ids) == len(ref.output_ids):
                exact += 1
            else:
                first.append(diff if diff is not None else min(len(r.output_ids), len(ref.output_ids)))
        out["exact_match"] = exact / len(results) if results else None
        out["first_mismatch"] = sorted(first)
    return out


def decode_benchmark(
    engine: SpecEngine,
    prompts: list[list[int]],
    max_new_tokens: int,
    num_steps: Sequence[int],
    warmup_prompts: int = 2,
) -> dict[str, Any]:
    """Baseline then each num_steps over the same prompts (after a warm-up of each); returns
    summarize_runs per config plus the raw results (key "results")."""
    for p in prompts[:warmup_prompts]:
        engine.greedy(p, max_new_tokens)
        for k in num_steps:
            engine.speculate(p, max_new_tokens, k)
    base = [engine.greedy(p, max_new_tokens) for p in prompts]
    out: dict[str, Any] = {"baseline": summarize_runs(base), "results": {"baseline": base}}
    for k in num_steps:
        spec = [engine.speculate(p, max_new_tokens, k) for p in prompts]
        out[f"spec_k{k}"] = summarize_runs(spec, base)
        out["results"][f"spec_k{k}"] = spec
    return out
