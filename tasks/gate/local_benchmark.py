"""The gate's protocol on the in-process speculative engine (tasks.gate.spec_engine).

Same configs (baseline + the topk=1 num_steps sweep), launch order, warm-up, held-out prompts,
per-request records, agreement with the baseline and acceptance floor as the SGLang protocol;
what differs: one engine stays loaded for the whole benchmark (a "launch" is one pass over the
prompts: a fresh process would only capture the same graphs again), and tok/s is decode speed,
tokens after the first over the decode loop's seconds, the quantity the cost model predicts.
The records feed the same decision, report and promotion. The lossless rule's evidence is the
same too (tasks/gate/lossless.py): after each baseline pass, the target's distribution at every
position of each prompt's reference output, from one transformers forward over prompt + reference
(SGLang's prefill re-score, locally).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import torch

from tasks.config.gate_section import GateConfig
from tasks.gate.benchmark import check_acceptance, run_protocol
from tasks.gate.lossless import PositionView, ReferenceEvidence, ReferenceOutputs, rescore_summary
from tasks.gate.plan import BenchConfig, GateStopped, is_default_chain
from tasks.gate.prompts import BenchPrompt
from tasks.gate.records import BenchResult, LaunchRecord, RequestRecord, accept_length
from tasks.gate.spec_engine import DecodeResult, SpecEngine


def local_configs(configs: list[BenchConfig]) -> list[BenchConfig]:
    """The configs the local engine can run: chains (topk=1), in the default environment."""
    return [c for c in configs if is_default_chain(c.env_name, c.spec.topk if c.spec else None)]


def drafts_histogram(result: DecodeResult) -> list[int]:
    """Verify steps by number of drafts accepted (index 0..k), SGLang's correct-drafts histogram."""
    counts = Counter(result.accepted)
    return [counts.get(j, 0) for j in range(result.num_steps + 1)]


@torch.inference_mode()
def rescore(model: torch.nn.Module, prompt_ids: list[int], reference: list[int], k: int) -> ReferenceEvidence:
    """The target's distribution at each position of `reference` after `prompt_ids`, and after
    the whole of it: transformers' logits of one forward over both (float32 log-softmax)."""
    device = next(model.parameters()).device
    ids = torch.tensor([[*prompt_ids, *reference]], dtype=torch.long, device=device)
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1 :].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    top = logprobs.topk(k, dim=-1)
    views = []
    for j, (tokens, values) in enumerate(zip(top.indices.tolist(), top.values.tolist(), strict=True)):
        token = reference[j] if j < len(reference) else None
        own = float(logprobs[j, token]) if token is not None else None
        views.append(PositionView(token, own, tuple(zip(tokens, values, strict=True))))
    return ReferenceEvidence(tuple(views), k)


class LocalGateRunner:
    """Runs `configs` on `engine` in protocol order; `run()` returns everything measured."""

    def __init__(
        self, cfg: GateConfig, engine: SpecEngine, configs: list[BenchConfig], prompts: list[BenchPrompt]
    ) -> None:
        if not prompts:
            raise GateStopped("no benchmark prompts")
        self.cfg, self.engine, self.prompts = cfg, engine, prompts
        self.configs = local_configs(configs)
        self.reference = ReferenceOutputs(cfg.near_tie_nats)

    def run(self) -> BenchResult:
        return run_protocol(self.configs, self.prompts, self.cfg.repetitions, self._launch)

    def _launch(self, rep: int, config: BenchConfig, record: LaunchRecord) -> None:
        record.url = f"local:{self.engine.device}"
        record.server_info = {"engine": "local_spec", "cuda_graphs": self.engine.use_cuda_graphs}
        warm = [self._request(config, -1, p) for p in self.prompts[: self.cfg.warmup_requests]]
        if config.spec is not None:
            record.warmup_accept_length = check_acceptance(self.cfg.acceptance_floor, config, warm, "after warm-up")
        record.requests = [self._request(config, rep, p) for p in self.prompts]
        if config.is_baseline:
            self._rescore(config, record)
        if config.spec is not None:
            check_acceptance(self.cfg.acceptance_floor, config, record.requests, "over the measured requests")

    def _rescore(self, config: BenchConfig, record: LaunchRecord) -> None:
        got: list[ReferenceEvidence | str] = []
        first: list[ReferenceEvidence | str | None] = []
        for prompt in self.prompts:
            reference = self.reference.reference(config.env_name, prompt.index)
            if reference is None:
                continue
            evidence = rescore(self.engine.model, list(prompt.input_ids), reference, self.cfg.top_logprobs_num)
            first.append(self.reference.evidence(config.env_name, prompt.index))
            self.reference.add_evidence(config.env_name, prompt.index, evidence)
            got.append(evidence)
        record.rescore = rescore_summary(got, first)

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
        if out.finish_reason == "stop":  # the local engine keeps the stop token in the output
            rec.stop_token = out.output_ids[-1]
        if config.spec is not None:
            rec.spec_verify_ct = out.verify_steps
            rec.accept_length = accept_length(rec.completion_tokens, out.verify_steps)
            rec.correct_drafts_histogram = drafts_histogram(out)
        rec.output_sha = hashlib.sha256(json.dumps(out.output_ids).encode()).hexdigest()[:16]
        self.reference.compare(rec, config, prompt, out.output_ids, rec.stop_token)
        return rec
