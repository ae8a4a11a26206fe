"""The gate's protocol on the in-process speculative engine (tasks.gate.spec_engine).

Same configs (baseline + the topk=1 num_steps sweep), launch order, warm-up, held-out prompts,
per-request records, agreement with the baseline and acceptance floor as the SGLang protocol;
what differs: one engine stays loaded for the whole benchmark (a "launch" is one pass over the
prompts: a fresh process would only capture the same graphs again), and tok/s is decode speed,
tokens after the first over the decode loop's seconds, the quantity the cost model predicts.
The records feed the same decision, report and promotion.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter

from tasks.config.gate_section import GateConfig
from tasks.gate.benchmark import BaselineOutputs, check_acceptance, run_protocol
from tasks.gate.plan import (
    BenchConfig,
    BenchPrompt,
    BenchResult,
    GateStopped,
    LaunchRecord,
    RequestRecord,
    accept_length,
    is_default_chain,
)
from tasks.gate.spec_engine import DecodeResult, SpecEngine


def local_configs(configs: list[BenchConfig]) -> list[BenchConfig]:
    """The configs the local engine can run: chains (topk=1), in the default environment."""
    return [c for c in configs if is_default_chain(c.env_name, c.spec.topk if c.spec else None)]


def drafts_histogram(result: DecodeResult) -> list[int]:
    """Verify steps by number of drafts accepted (index 0..k), SGLang's correct-drafts histogram."""
    counts = Counter(result.accepted)
    return [counts.get(j, 0) for j in range(result.num_steps + 1)]


class LocalGateRunner:
    """Runs `configs` on `engine` in protocol order; `run()` returns everything measured."""

    def __init__(
        self, cfg: GateConfig, engine: SpecEngine, configs: list[BenchConfig], prompts: list[BenchPrompt]
    ) -> None:
        if not prompts:
            raise GateStopped("no benchmark prompts")
        self.cfg, self.engine, self.prompts = cfg, engine, prompts
        self.configs = local_configs(configs)
        self.reference = BaselineOutputs()

    def run(self) -> BenchResult:
        return run_protocol(self.configs, self.prompts, self.cfg.repetitions, self._launch)

    def _launch(self, rep: int, config: BenchConfig, record: LaunchRecord) -> None:
        record.url = f"local:{self.engine.device}"
        record.server_info = {"engine": "local_spec", "cuda_graphs": self.engine.use_cuda_graphs}
        warm = [self._request(config, -1, p) for p in self.prompts[: self.cfg.warmup_requests]]
        if config.spec is not None:
            record.warmup_accept_length = check_acceptance(self.cfg.acceptance_floor, config, warm, "after warm-up")
        record.requests = [self._request(config, rep, p) for p in self.prompts]
        if config.spec is not None:
            check_acceptance(self.cfg.acceptance_floor, config, record.requests, "over the measured requests")

    def _request(self, config: BenchConfig, rep: int, prompt: BenchPrompt) -> RequestRecord:
        rec = RequestRecord(config.name, config.env_name, rep, prompt.index, prompt.prompt_id, prompt.domain)
        ids = list(prompt.input_ids)
        try:
            if config.spec is None:
                out = self.engine.greedy(ids, self.cfg.max_new_tokens)
            else:
                out = self.engine.speculate(ids, self.cfg.max_new_tokens, config.spec.num_steps)
        except ValueError as e:  # a prompt too long for the engine's static cache
            rec.error = f"{type(e).__name__}: {e}"
            return rec
        rec.completion_tokens = len(out.output_ids)
        rec.latency_s = out.prefill_s + out.decode_s
        rec.tok_s = out.decode_tokens / out.decode_s if out.decode_s > 0 and out.decode_tokens > 0 else None
        rec.finish = out.finish_reason
        if config.spec is not None:
            rec.spec_verify_ct = out.verify_steps
            rec.accept_length = accept_length(rec.completion_tokens, out.verify_steps)
            rec.correct_drafts_histogram = drafts_histogram(out)
        rec.output_sha = hashlib.sha256(json.dumps(out.output_ids).encode()).hexdigest()[:16]
        self.reference.compare(rec, config, prompt, out.output_ids)
        return rec
