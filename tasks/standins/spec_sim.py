"""An SGLang launch emulator's backend: speculative decoding's metrics and timing, logged the
way SGLang's scheduler logs them. The CLI that takes SGLang's flags is spec_launch.py.

The gate (tasks/gate/) launches `python -m sglang.launch_server ARGS` on GPU nodes; in CI and
dry runs it launches `python -m tasks.standins.spec_launch --sim-config-json J ARGS` with
the same ARGS, so the launch-command builder, the health wait, the server-info check, the log
parser and the benchmark protocol all run against a real process over real HTTP.

What is emulated (field names and log formats read from SGLang's tokenizer manager, scheduler
metrics mixin and EAGLE worker):
- the CLI of the pinned version: 0.5.4 takes --cuda-graph-max-bs / --disable-cuda-graph,
  0.5.23 takes --cuda-graph-max-bs-decode / --disable-decode-cuda-graph and rejects the old
  max-bs flag, 0.5.14 takes the flags of its recorded --help; with topk=1 a draft-token count other than steps+1 is silently adjusted, as
  SGLang does (a warning in the log, the adjusted value in server info);
- outputs: a deterministic function of the prompt ids, so baseline and speculative agree
  token for token unless `disagree_from` is set;
- speculation: each verify cycle accepts a run of draft tokens drawn from per-position
  acceptance probabilities (seeded); meta_info carries spec_verify_ct (and, for 0.5.14 and
  0.5.23, the accept length/rate, draft counts and the correct-drafts histogram: for 0.5.14
  exactly the recorded keys); without --skip-tokenizer-init an answer also has "text";
- time: prefill, then baseline steps or verify cycles (draft steps + a verify step), scaled by
  a per-launch and a per-request speed factor (the run-to-run spread);
- log lines: CUDA-graph capture begin/end for the target (verify) graph and the draft and
  draft-extend graphs, and `Decode batch ... accept len: X, ... cuda graph: True, gen
  throughput (token/s): Y` every `decode_log_interval` forward steps.
Failure switches: `stuck_acceptance` (every draft rejected: the EAGLE-vs-EAGLE3 symptom),
`disagree_from`, `never_healthy` (hangs in CUDA-graph capture; /health_generate never passes),
`max_topk` (a tree config above it exits during start-up).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field, fields
from typing import Any

from tasks.standins.backends import BackendInput, BackendOutput
from tasks.standins.sim import SIM_EOS_ID

EMULATED_VERSIONS = ("0.5.4", "0.5.14", "0.5.23")


@dataclass
class SpecSimConfig:
    sglang_version: str = "0.5.23"
    prefill_s: float = 0.001
    baseline_step_s: float = 0.002
    verify_step_s: float = 0.0025
    verify_token_s: float = 0.0  # added per draft token verified
    draft_step_s: float = 0.0003
    accept_probs: list[float] = field(default_factory=lambda: [0.8, 0.7, 0.6, 0.5, 0.4])
    launch_jitter: float = 0.0  # stdev of the per-launch speed factor
    request_jitter: float = 0.0  # stdev of the per-request speed factor
    seed: int = 0
    vocab_size: int = 32000
    min_new_fraction: float = 0.5  # completions are between this fraction of max_new_tokens and all
    decode_log_interval: int = 8
    disagree_from: int | None = None  # speculative outputs diverge from the baseline at this token
    stuck_acceptance: bool = False
    never_healthy: bool = False
    # A launch with --speculative-eagle-topk above this exits during start-up, as a server whose
    # attention backend has no tree-verify kernels would.
    max_topk: int | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpecSimConfig:
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"sim config: unknown field(s) {unknown}")
        cfg = cls(**data)
        if cfg.sglang_version not in EMULATED_VERSIONS:
            raise ValueError(f"sim config: sglang_version {cfg.sglang_version!r} not in {EMULATED_VERSIONS}")
        if not cfg.accept_probs or not all(0.0 <= p <= 1.0 for p in cfg.accept_probs):
            raise ValueError(f"sim config: accept_probs must be probabilities, got {cfg.accept_probs}")
        return cfg


def speed_factor(rng: random.Random, jitter: float) -> float:
    """A multiplicative time factor around 1 (bounded so no step takes negative time)."""
    return max(0.3, 1.0 + jitter * rng.gauss(0.0, 1.0)) if jitter > 0 else 1.0


def launch_speed_factor(seed: int, launch_index: int, jitter: float) -> float:
    """The time factor of launch `launch_index` (tests use it to know the emulated spread)."""
    return speed_factor(random.Random(f"launch:{seed}:{launch_index}"), jitter)


def planned_output(input_ids: list[int], max_new: int, ignore_eos: bool, cfg: SpecSimConfig) -> tuple[list[int], str]:
    """The completion of a prompt: a deterministic function of its ids and max_new_tokens."""
    if max_new <= 0:
        return [], "length"
    digest = hashlib.blake2b(json.dumps(input_ids).encode(), digest_size=8).hexdigest()
    rng = random.Random(f"{digest}:{max_new}")
    n = max_new if ignore_eos else rng.randint(max(1, math.ceil(max_new * cfg.min_new_fraction)), max_new)
    ids = [4 + rng.randrange(cfg.vocab_size - 4) for _ in range(n)]
    if n < max_new:
        ids[-1] = SIM_EOS_ID
        return ids, "stop"
    return ids, "length"


def _diverge(ids: list[int], start: int, finish: str, cfg: SpecSimConfig) -> list[int]:
    """`ids` changed from index `start` on (the first changed token is exactly at `start`)."""
    end = len(ids) - 1 if finish == "stop" else len(ids)
    if start >= end:
        return ids
    rng = random.Random(f"diverge:{start}:{ids[start]}")
    out = list(ids)
    for i in range(start, end):
        new = 4 + rng.randrange(cfg.vocab_size - 4)
        out[i] = new if new != ids[i] else 4 + (new - 3) % (cfg.vocab_size - 4)
    return out


@dataclass
class LaunchArgs:
    """The subset of SGLang's server args the emulator reads (names as in ServerArgs)."""

    model_path: str
    host: str
    port: int
    tp_size: int
    speculative_algorithm: str | None
    speculative_draft_model_path: str | None
    speculative_num_steps: int | None
    speculative_eagle_topk: int | None
    speculative_num_draft_tokens: int | None
    cuda_graph_max_bs: int | None
    disable_cuda_graph: bool
    disable_prefill_cuda_graph: bool
    max_running_requests: int | None
    max_total_tokens: int | None
    mem_fraction_static: float | None
    context_length: int | None
    skip_tokenizer_init: bool
    attention_backend: str | None
    sampling_backend: str | None
    grammar_backend: str | None
    dtype: str | None
    sleep_on_idle: bool
    random_seed: int | None
    nccl_port: int | None = None  # bound for the server's life, as torch.distributed's store is


def sglang_log(message: str, rank: bool = True) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"[{stamp}{' TP0' if rank else ''}] {message}", file=sys.stderr, flush=True)


class SpecSimBackend:
    """Generates per SpecSimConfig, one request at a time (a bs=1 GPU at concurrency 1)."""

    kind = "spec-sim"

    def __init__(self, cfg: SpecSimConfig, args: LaunchArgs, launch_index: int = 0) -> None:
        self.cfg = cfg
        self.args = args
        self.model_path = args.model_path
        self.context_length = args.context_length or 32768
        self.max_running_requests = args.max_running_requests or 1
        self.speculative = args.speculative_algorithm is not None
        self._launch_factor = launch_speed_factor(cfg.seed, launch_index, cfg.launch_jitter)
        self._rng = random.Random(f"requests:{cfg.seed}:{launch_index}")
        self._lock: asyncio.Lock | None = None
        self._forward_ct = 0
        self._rank = cfg.sglang_version != "0.5.14" or args.tp_size > 1  # 0.5.14 on one GPU: no " TP0"
        self._window = {"forward": 0, "tokens": 0, "time": 0.0}
        self.requests = 0

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode())

    def server_info_extra(self) -> dict[str, Any]:
        a = self.args
        old = self.cfg.sglang_version == "0.5.4"
        return {
            "version": self.cfg.sglang_version,
            "model_path": a.model_path,
            "tp_size": a.tp_size,
            "speculative_algorithm": a.speculative_algorithm,
            "speculative_draft_model_path": a.speculative_draft_model_path,
            "speculative_num_steps": a.speculative_num_steps,
            "speculative_eagle_topk": a.speculative_eagle_topk,
            "speculative_num_draft_tokens": a.speculative_num_draft_tokens,
            ("cuda_graph_max_bs" if old else "cuda_graph_max_bs_decode"): a.cuda_graph_max_bs,
            ("disable_cuda_graph" if old else "disable_decode_cuda_graph"): a.disable_cuda_graph,
            **({} if old else {"disable_prefill_cuda_graph": a.disable_prefill_cuda_graph}),
            "skip_tokenizer_init": a.skip_tokenizer_init,
            "attention_backend": a.attention_backend,
            "sampling_backend": a.sampling_backend,
            "grammar_backend": a.grammar_backend,
            "dtype": a.dtype or "auto",
            "sleep_on_idle": a.sleep_on_idle,
            "max_total_tokens": a.max_total_tokens,
            "random_seed": a.random_seed,
            "eaglescale_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
        }

    async def generate(self, items: list[BackendInput]) -> list[BackendOutput]:
        if self.cfg.never_healthy:
            raise RuntimeError("the scheduler is still capturing CUDA graphs")
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            return [await self._one(item) for item in items]

    def _cycle(self) -> int:
        """Draft tokens the target accepts in one verify cycle."""
        if self.cfg.stuck_acceptance:
            return 0
        probs, topk = self.cfg.accept_probs, self.args.speculative_eagle_topk or 1
        accepted = 0
        for i in range(self.args.speculative_num_steps or 0):
            p = probs[min(i, len(probs) - 1)]
            # A tree of topk branches gives each depth about topk tries.
            if self._rng.random() >= 1.0 - (1.0 - p) ** topk:
                break
            accepted += 1
        return accepted

    async def _one(self, item: BackendInput) -> BackendOutput:
        cfg, a = self.cfg, self.args
        self.requests += 1
        ids, finish = planned_output(item.input_ids, item.sampling.max_new_tokens, item.ignore_eos, cfg)
        if self.speculative and cfg.disagree_from is not None:
            ids = _diverge(ids, cfg.disagree_from, finish, cfg)
        steps: list[tuple[int, float]] = []  # (tokens, seconds) per forward step after prefill
        hist = [0] * ((a.speculative_num_steps or 0) + 1)
        left = max(0, len(ids) - 1)
        while left > 0:
            if self.speculative:
                accepted = min(self._cycle(), left - 1)
                hist[accepted] += 1
                cost = (a.speculative_num_steps or 0) * cfg.draft_step_s + cfg.verify_step_s
                cost += cfg.verify_token_s * (a.speculative_num_draft_tokens or 0)
                steps.append((accepted + 1, cost))
            else:
                steps.append((1, cfg.baseline_step_s))
            left -= steps[-1][0]
        factor = self._launch_factor * speed_factor(self._rng, cfg.request_jitter)
        await asyncio.sleep(factor * (cfg.prefill_s + sum(s for _, s in steps)))
        self._log_prefill(len(item.input_ids), factor)
        self._log_decode(steps, factor)
        reason: dict[str, Any] = {"type": "stop", "matched": SIM_EOS_ID} if finish == "stop" else {"type": "length", "length": len(ids)}
        text = "".join(chr(97 + i % 26) for i in ids)
        return BackendOutput(ids, text, reason, meta_extra=self._spec_meta(len(ids), len(steps), hist))

    def _spec_meta(self, completion: int, verify_ct: int, hist: list[int]) -> dict[str, Any]:
        """A speculative answer's meta_info fields. 0.5.14's (recorded, gen-eagle3.json) are the
        nine below, in that order, with the histogram cut after its last non-zero count; 0.5.23
        keeps the full num_steps + 1 histogram; 0.5.4 has spec_verify_ct only."""
        if not self.speculative:
            return {}
        version = self.cfg.sglang_version
        if version == "0.5.4" or (version == "0.5.23" and verify_ct == 0):
            return {"spec_verify_ct": verify_ct}
        correct = sum(k * c for k, c in enumerate(hist))
        proposed = verify_ct * ((self.args.speculative_num_draft_tokens or 1) - 1)
        if version == "0.5.14":
            hist = hist[: max(1, max((k + 1 for k, c in enumerate(hist) if c), default=1))]
        # verify_ct 0 (a one-token answer) was not recorded; the ratios read 0 and the length
        # is the completion itself.
        return {
            "spec_accept_rate": correct / proposed if proposed else 0.0,
            "spec_accept_length": completion / verify_ct if verify_ct else float(completion),
            "spec_num_correct_drafts": correct,
            "spec_num_proposed_drafts": proposed,
            "spec_verify_ct": verify_ct,
            "spec_accepted_drafts": correct,
            "spec_proposed_drafts": proposed,
            "spec_correct_drafts_histogram": list(hist),
            "spec_accept_histogram": list(hist),
        }

    def _log_prefill(self, n_input: int, factor: float) -> None:
        """0.5.14's `Prefill batch` line, one per request (its recorded wording)."""
        if self.cfg.sglang_version != "0.5.14":
            return
        graph = not (self.speculative or self.args.disable_prefill_cuda_graph or self.args.disable_cuda_graph)
        seconds = factor * self.cfg.prefill_s
        sglang_log(
            f"Prefill batch, #new-seq: 1, #new-token: {n_input}, #cached-token: 0, token usage: 0.00, "
            f"#running-req: 0, #queue-req: 0, #pending-token: 0, cuda graph: {graph}, "
            f"input throughput (token/s): {n_input / seconds if seconds else 0:.2f}",
            self._rank,
        )

    def _log_decode(self, steps: list[tuple[int, float]], factor: float) -> None:
        """One `Decode batch` line per decode_log_interval forward steps, SGLang's format."""
        w = self._window
        for tokens, seconds in steps:
            self._forward_ct += 1
            w["forward"] += 1
            w["tokens"] += tokens
            w["time"] += seconds * factor
            if self._forward_ct % self.cfg.decode_log_interval:
                continue
            old = self.cfg.sglang_version == "0.5.4"
            msg = f"Decode batch{'.' if old else ','} #running-req: 1, #token: {w['tokens']}, token usage: 0.00, "
            if self.speculative:
                msg += f"accept len: {w['tokens'] / w['forward']:.2f}, "
                if not old:
                    drafts = w["forward"] * ((self.args.speculative_num_draft_tokens or 1) - 1)
                    msg += f"accept rate: {(w['tokens'] - w['forward']) / drafts if drafts else 0:.2f}, "
            msg += f"cuda graph: {not self.args.disable_cuda_graph}, "
            msg += f"gen throughput (token/s): {w['tokens'] / w['time'] if w['time'] else 0:.2f}, #queue-req: 0"
            sglang_log(msg + (", " if old else ""), self._rank)
            w.update(forward=0, tokens=0, time=0.0)

    def flush_cache(self) -> None:
        sglang_log("Cache flushed successfully!")

    def stats(self) -> dict[str, Any]:
        return {"requests": self.requests, "forward_ct": self._forward_ct, "launch_factor": self._launch_factor}

    async def close(self) -> None:
        return None
