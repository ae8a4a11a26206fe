"""Speculative decoding in the simulator: how a verify cycle costs and what it accepts
(`Speculation`), and SGLang's scheduler log lines (`SchedulerLog`)."""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass
from typing import Any

from tasks.sglang.simulated_acceptance import simulated_tokens
from tasks.standins.sim_logprobs import CHANGE, FLIP, SyntheticDistribution


@dataclass
class Speculation:
    """EAGLE-style decoding: each decode step is a verify cycle of `num_steps` draft steps (or,
    under adaptive speculation, the step count in effect for that batch) whose tokens the target
    accepts with per-depth probabilities; answers carry the version's spec_* meta_info fields."""

    sglang_version: str
    num_steps: int
    topk: int
    num_draft_tokens: int
    accept_probs: list[float]
    draft_step_s: float
    verify_step_s: float
    verify_token_s: float = 0.0  # added per draft token verified
    # Added to each draft step per running request: a draft forward grows with the batch too.
    draft_batch_token_s: float = 0.0
    stuck_acceptance: bool = False  # every draft rejected: the EAGLE-vs-EAGLE3 symptom
    disagree_from: int | None = None  # answers diverge from the plain ones at this token
    # Where answers leave the plain ones (deviation): the target's synthetic distribution, the
    # share of its near-ties a verify flips (bf16 verify vs decode), the first confident position
    # from which the runner-up is emitted instead (a server that changes output).
    distribution: SyntheticDistribution | None = None
    near_tie_flip_rate: float = 0.0
    wrong_token_from: int | None = None
    # SGLANG_SIMULATE_ACC_LEN (tasks/sglang/simulated_acceptance.py): tokens per verify forced
    # to this mean, outputs filled with SGLang's token 100.
    simulate_acc_len: float | None = None
    simulate_method: str = "multinomial"

    def deviation(self, key: str, ids: list[int], finish: str, frequency_penalty: float) -> tuple[int, int, str] | None:
        """(position, token, kind) where this launch's answer to `key` first leaves the plain one
        `ids`: a flipped near-tie (the runner-up; FLIP: the verify's own logits put it first),
        the wrong-token fault (the runner-up at a confident position) or, with a frequency
        penalty, SGLang's relaxed penalty under speculation (the token just emitted, emitted
        again, at a confident position: decode penalized it, the verify's penalty had not
        counted it yet); both CHANGE: the verify's own logits still put the plain token first.
        None: no deviation. The first token comes from prefill, as in the plain launch, and the
        stop token stays."""
        dist = self.distribution
        if dist is None or not (self.near_tie_flip_rate or self.wrong_token_from is not None or frequency_penalty > 0):
            return None
        end = len(ids) - 1 if finish == "stop" else len(ids)
        for i in range(1, end):
            if dist.is_near_tie(key, i):
                if self.near_tie_flip_rate and dist.flip_draw(key, i) < self.near_tie_flip_rate:
                    return i, dist.runner_up(key, i, ids[i]), FLIP
            elif self.wrong_token_from is not None and i >= self.wrong_token_from:
                return i, dist.runner_up(key, i, ids[i]), CHANGE
            elif frequency_penalty > 0 and ids[i - 1] != ids[i]:
                return i, ids[i - 1], CHANGE
        return None

    def draft_tokens(self, steps: int) -> int:
        """Tokens per request a verify at `steps` draft steps checks: the launch's own count at
        its own steps (a tree has more than steps + 1), a chain's steps + 1 at another."""
        return self.num_draft_tokens if steps == self.num_steps else steps + 1

    def cycle_s(self, batch: int, steps: int, batch_token_s: float = 0.0) -> float:
        """One verify cycle of `batch` requests at `steps` draft steps. `batch_token_s` is the
        target's cost per token it processes: at a large batch the verify of steps + 1 tokens
        per request is compute-bound, which is why speculation stops paying under load."""
        # At steps 0 (an adaptive tier with speculation off) the draft still extends over the
        # verified token: one draft forward, as SGLang 0.5.14's worker runs it.
        draft = max(steps, 1) * (self.draft_step_s + self.draft_batch_token_s * batch)
        verified = self.draft_tokens(steps) * batch
        return draft + self.verify_step_s + (self.verify_token_s + batch_token_s) * verified

    def accepted(self, rng: random.Random, steps: int) -> int:
        """Draft tokens the target accepts in one verify cycle of `steps` draft steps."""
        if self.stuck_acceptance or steps == 0:
            return 0
        if self.simulate_acc_len is not None:
            return simulated_tokens(rng, self.simulate_acc_len, steps, self.simulate_method) - 1
        accepted = 0
        for i in range(steps):
            p = self.accept_probs[min(i, len(self.accept_probs) - 1)]
            # A tree of topk branches gives each depth about topk tries.
            if rng.random() >= 1.0 - (1.0 - p) ** self.topk:
                break
            accepted += 1
        return accepted

    def meta_info(self, completion: int, verify_ct: int, hist: list[int]) -> dict[str, Any]:
        """A speculative answer's meta_info fields. 0.5.14's (recorded, gen-eagle3.json) are the
        nine below, in that order, with the histogram cut after its last non-zero count; 0.5.23
        keeps the full num_steps + 1 histogram; 0.5.4 has spec_verify_ct only. Proposed drafts
        count the launch's num_draft_tokens per verify, whatever step count an adaptive server
        ran (SGLang's tokenizer manager reads its server args)."""
        version = self.sglang_version
        if version == "0.5.4" or (version == "0.5.23" and verify_ct == 0):
            return {"spec_verify_ct": verify_ct}
        correct = sum(k * c for k, c in enumerate(hist))
        proposed = verify_ct * (self.num_draft_tokens - 1)
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


# --- SGLang's scheduler log --------------------------------------------------------------------


def sglang_log(message: str, rank: bool = True) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"[{stamp}{' TP0' if rank else ''}] {message}", file=sys.stderr, flush=True)


@dataclass
class SchedulerLog:
    """SGLang's `Prefill batch` (0.5.14's recorded wording) and `Decode batch` lines, the latter
    once per `decode_log_interval` decode steps with the window's accept length and throughput."""

    sglang_version: str
    rank: bool  # whether lines carry " TP0" (0.5.14 on one GPU prints none)
    decode_log_interval: int
    prefill_graph: bool
    decode_graph: bool
    speculation: Speculation | None
    _forward_ct: int = 0
    # The window since the last Decode batch line: verify cycles (one per running request per
    # step), tokens and seconds.
    _cycles: int = 0
    _tokens: int = 0
    _seconds: float = 0.0

    def prefill(self, new_tokens: list[int], running: int, queued: int, seconds: float) -> None:
        if self.sglang_version != "0.5.14":
            return
        n_input = sum(new_tokens)
        sglang_log(
            f"Prefill batch, #new-seq: {len(new_tokens)}, #new-token: {n_input}, #cached-token: 0, token usage: 0.00, "
            f"#running-req: {running}, #queue-req: {queued}, #pending-token: 0, cuda graph: {self.prefill_graph}, "
            f"input throughput (token/s): {n_input / seconds if seconds else 0:.2f}",
            self.rank,
        )

    def decode(self, running: int, tokens: int, seconds: float, queued: int) -> None:
        self._forward_ct += 1
        self._cycles += running
        self._tokens += tokens
        self._seconds += seconds
        if self._forward_ct % self.decode_log_interval:
            return
        old = self.sglang_version == "0.5.4"
        msg = f"Decode batch{'.' if old else ','} #running-req: {running}, #token: {self._tokens}, token usage: 0.00, "
        if self.speculation is not None:
            msg += f"accept len: {self._tokens / self._cycles:.2f}, "
            if not old:
                drafts = self._cycles * (self.speculation.num_draft_tokens - 1)
                msg += f"accept rate: {(self._tokens - self._cycles) / drafts if drafts else 0:.2f}, "
        msg += f"cuda graph: {self.decode_graph}, "
        msg += f"gen throughput (token/s): {self._tokens / self._seconds if self._seconds else 0:.2f}, #queue-req: {queued}"
        sglang_log(msg + (", " if old else ""), self.rank)
        self._cycles = self._tokens = 0
        self._seconds = 0.0
