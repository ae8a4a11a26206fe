"""The SGLang simulator: one continuous-batching timing model with a plain and a speculative
behaviour, behind the stand-in server (`serve-sglang --simulate`) and the launch emulator.

Scheduling: at most `max_batch` requests run and the rest queue; a request that arrives during
a step joins at the next step boundary, as with a real scheduler. The step that admits a request
prefills it and yields its first token; every later step decodes: one token per running request
(plain) or a verify cycle's accepted draft tokens plus one (speculative). A step takes the longer
of its prefill and decode parts, scaled by a per-launch and a per-request speed factor.

Outputs are deterministic: the completion's length, its end (stop or length) and its ids depend
only on a key, the rid (so a test or benchmark can predict every answer) or the prompt ids (so
two launches agree token for token on a prompt, as greedy decoding does). A speculative answer
is the plain one (unless told to diverge) with SGLang's spec_* meta_info fields; a scheduler log
writes SGLang's `Prefill batch` and `Decode batch` lines. With zero step times requests complete
at once (raw HTTP overhead).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from tasks.sglang.simulated_acceptance import SIMULATED_TOKEN, simulated_tokens
from tasks.standins.backends import BackendInput, BackendOutput
from tasks.standins.sim_logprobs import CHANGE, FLIP, SyntheticDistribution

SIM_EOS_ID = 2
_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,"


# --- what a request generates ------------------------------------------------------------------


@dataclass(frozen=True)
class CompletionPlan:
    n_tokens: int
    finish: str  # "stop" | "length"


def plan_completion(key: str, max_new_tokens: int, ignore_eos: bool = False, min_new_fraction: float = 0.0) -> CompletionPlan:
    """How long the simulated completion of `key` is and why it ends.

    The natural length is uniform from max(1, min_new_fraction * max_new_tokens) to twice
    max_new_tokens and is cut at max_new_tokens; with no floor about half of the requests stop
    early and half are cut.
    """
    if max_new_tokens <= 0:
        return CompletionPlan(0, "length")
    if ignore_eos:
        return CompletionPlan(max_new_tokens, "length")
    shortest = max(1, math.ceil(max_new_tokens * min_new_fraction))
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
    natural = shortest + h % (2 * max_new_tokens - shortest + 1)
    if natural > max_new_tokens:
        return CompletionPlan(max_new_tokens, "length")
    return CompletionPlan(natural, "stop")


def simulated_output(key: str, plan: CompletionPlan, vocab_size: int) -> BackendOutput:
    """The deterministic output of `key`: ids from a key-seeded RNG, the stop token last."""
    rng = random.Random(key)
    # Ids 0..3 are reserved specials so a generated id never collides with the stop token.
    ids = [4 + rng.randrange(vocab_size - 4) for _ in range(plan.n_tokens)]
    if plan.finish == "stop":
        ids[-1] = SIM_EOS_ID
    return _answer(ids, plan.finish)


def _answer(ids: list[int], finish: str) -> BackendOutput:
    """Ids as SGLang answers them: the text leaves out the stop token the finish reason names."""
    if finish == "stop":
        reason: dict[str, Any] = {"type": "stop", "matched": SIM_EOS_ID}
        shown = ids[:-1]
    else:
        reason = {"type": "length", "length": len(ids)}
        shown = ids
    return BackendOutput(ids, "".join(_ALPHABET[i % len(_ALPHABET)] for i in shown), reason)


def prompt_key(input_ids: list[int]) -> str:
    return hashlib.blake2b(json.dumps(input_ids).encode(), digest_size=8).hexdigest()


def _diverge(ids: list[int], start: int, finish: str, vocab_size: int) -> list[int]:
    """`ids` changed from index `start` on (the first changed token is exactly at `start`)."""
    end = len(ids) - 1 if finish == "stop" else len(ids)
    if start >= end:
        return ids
    rng = random.Random(f"diverge:{start}:{ids[start]}")
    out = list(ids)
    for i in range(start, end):
        new = 4 + rng.randrange(vocab_size - 4)
        out[i] = new if new != ids[i] else 4 + (new - 3) % (vocab_size - 4)
    return out


def speed_factor(rng: random.Random, jitter: float) -> float:
    """A multiplicative time factor around 1 (bounded so no step takes negative time)."""
    return max(0.3, 1.0 + jitter * rng.gauss(0.0, 1.0)) if jitter > 0 else 1.0


def launch_speed_factor(seed: int, launch_index: int, jitter: float) -> float:
    """The time factor of launch `launch_index` (tests use it to know the emulated spread)."""
    return speed_factor(random.Random(f"launch:{seed}:{launch_index}"), jitter)


# --- the two behaviours ------------------------------------------------------------------------


@dataclass(frozen=True)
class StepTimes:
    prefill_s: float  # a step that prefills (and yields the first token of) newly admitted requests
    decode_s: float  # a plain decode step


@dataclass
class Speculation:
    """EAGLE-style decoding: each decode step is a verify cycle of `num_steps` draft steps whose
    tokens the target accepts with per-depth probabilities; answers carry the version's spec_*
    meta_info fields."""

    sglang_version: str
    num_steps: int
    topk: int
    num_draft_tokens: int
    accept_probs: list[float]
    draft_step_s: float
    verify_step_s: float
    verify_token_s: float = 0.0  # added per draft token verified
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

    def cycle_s(self, batch: int) -> float:
        return self.num_steps * self.draft_step_s + self.verify_step_s + self.verify_token_s * self.num_draft_tokens * batch

    def accepted(self, rng: random.Random) -> int:
        """Draft tokens the target accepts in one verify cycle."""
        if self.stuck_acceptance:
            return 0
        if self.simulate_acc_len is not None:
            return simulated_tokens(rng, self.simulate_acc_len, self.num_steps, self.simulate_method) - 1
        accepted = 0
        for i in range(self.num_steps):
            p = self.accept_probs[min(i, len(self.accept_probs) - 1)]
            # A tree of topk branches gives each depth about topk tries.
            if rng.random() >= 1.0 - (1.0 - p) ** self.topk:
                break
            accepted += 1
        return accepted

    def meta_info(self, completion: int, verify_ct: int, hist: list[int]) -> dict[str, Any]:
        """A speculative answer's meta_info fields. 0.5.14's (recorded, gen-eagle3.json) are the
        nine below, in that order, with the histogram cut after its last non-zero count; 0.5.23
        keeps the full num_steps + 1 histogram; 0.5.4 has spec_verify_ct only."""
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


# --- the simulator -----------------------------------------------------------------------------


class _Running:
    __slots__ = ("item", "output", "emitted", "factor", "hist", "verify_ct", "future")

    def __init__(self, item: BackendInput, output: BackendOutput, future: asyncio.Future[BackendOutput], hist_size: int) -> None:
        self.item = item
        self.output = output
        self.emitted = 0
        self.factor = 1.0
        self.hist = [0] * hist_size  # verify cycles by accepted draft tokens
        self.verify_ct = 0
        self.future = future


class SimulatedBackend:
    """Continuous batching over `StepTimes`, plain or (with a `Speculation`) speculative."""

    kind = "simulated"

    def __init__(
        self,
        *,
        times: StepTimes,
        max_batch: int = 64,
        context_length: int = 32768,
        vocab_size: int = 32000,
        model_path: str = "simulated",
        outputs_follow_prompt: bool = False,
        min_new_fraction: float = 0.0,
        speculation: Speculation | None = None,
        log: SchedulerLog | None = None,
        launch_factor: float = 1.0,
        request_jitter: float = 0.0,
        seed: str = "",
    ) -> None:
        if times.prefill_s < 0 or times.decode_s < 0:
            raise ValueError(f"step times must be >= 0, got {times}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if vocab_size <= 4:
            raise ValueError(f"vocab_size must be > 4, got {vocab_size}")
        self.model_path = model_path
        self.context_length = context_length
        self.max_running_requests = max_batch
        self._vocab_size = vocab_size
        self._times = times
        self._max_batch = max_batch
        self._outputs_follow_prompt = outputs_follow_prompt
        self._min_new_fraction = min_new_fraction
        self._speculation = speculation
        self._log = log
        self._launch_factor = launch_factor
        self._request_jitter = request_jitter
        self._rng = random.Random(seed)  # acceptance and per-request speed draws
        self._waiting: deque[_Running] = deque()
        self._running: list[_Running] = []
        self._wake: asyncio.Event | None = None
        self._stepper: asyncio.Task[None] | None = None
        self._requests = 0
        self._steps = 0
        self._tokens = 0
        self._max_running = 0
        self._max_waiting = 0
        self._late_s = 0.0  # how far step ends fell behind their schedule, summed
        self._restarts = 0  # timeline restarts after falling a whole step behind

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode())

    def _planned_output(self, item: BackendInput) -> BackendOutput:
        """What `item` generates; a speculative launch told to disagree changes it from a token on."""
        key = prompt_key(item.input_ids) if self._outputs_follow_prompt else item.rid
        plan = plan_completion(key, item.sampling.max_new_tokens, item.ignore_eos, self._min_new_fraction)
        out = simulated_output(key, plan, self._vocab_size)
        spec = self._speculation
        if spec is None:
            return out
        if spec.simulate_acc_len is not None:  # the first token from prefill, then SGLang's filler
            return _answer(out.output_ids[:1] + [SIMULATED_TOKEN] * (plan.n_tokens - 1), "length")
        if spec.disagree_from is not None:
            return _answer(_diverge(out.output_ids, spec.disagree_from, plan.finish, self._vocab_size), plan.finish)
        deviation = spec.deviation(key, out.output_ids, plan.finish, item.frequency_penalty)
        if deviation is None:
            return out
        at, token, kind = deviation
        ids = _diverge(out.output_ids, at + 1, plan.finish, self._vocab_size)
        ids[at] = token
        answer = _answer(ids, plan.finish)
        answer.deviation = (at, out.output_ids[at], kind)
        return answer

    async def generate(self, items: list[BackendInput]) -> list[BackendOutput]:
        self._requests += len(items)
        outputs = [self._planned_output(i) for i in items]
        # Zero step times answer at once; a speculative answer still needs its verify cycles run.
        if self._times.prefill_s == self._times.decode_s == 0 and self._speculation is None:
            self._tokens += sum(len(o.output_ids) for o in outputs)
            return outputs
        if self._stepper is None:
            self._wake = asyncio.Event()
            self._stepper = asyncio.create_task(self._step_forever())
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        hist_size = self._speculation.num_steps + 1 if self._speculation is not None else 0
        entries = [_Running(i, o, loop.create_future(), hist_size) for i, o in zip(items, outputs, strict=True)]
        self._waiting.extend(entries)
        self._max_waiting = max(self._max_waiting, len(self._waiting))
        self._wake.set()
        return list(await asyncio.gather(*(e.future for e in entries)))

    def _admit(self) -> list[_Running]:
        """Move waiting requests into the batch; answer those with nothing to generate at once."""
        admitted: list[_Running] = []
        while self._waiting and len(self._running) + len(admitted) < self._max_batch:
            entry = self._waiting.popleft()
            if entry.future.done():  # its handler was cancelled (server shutting down)
                continue
            if not entry.output.output_ids:
                self._finish(entry)
                continue
            entry.factor = speed_factor(self._rng, self._request_jitter)
            admitted.append(entry)
        self._max_running = max(self._max_running, len(self._running) + len(admitted))
        return admitted

    def _step_seconds(self, admitted: list[_Running]) -> tuple[float, float]:
        """(prefill part, decode part) of the next step; the step takes the longer."""
        prefill = self._times.prefill_s if admitted else 0.0
        if not self._running:
            decode = 0.0
        elif self._speculation is not None:
            decode = self._speculation.cycle_s(len(self._running))
        else:
            decode = self._times.decode_s
        # The batch moves at its slowest request's pace.
        factor = self._launch_factor * max(e.factor for e in [*self._running, *admitted])
        return prefill * factor, decode * factor

    async def _step_forever(self) -> None:
        assert self._wake is not None
        deadline = time.monotonic()
        while True:
            admitted = self._admit()
            if not self._running and not admitted:
                self._wake.clear()
                await self._wake.wait()
                deadline = time.monotonic()
                continue
            prefill_s, decode_s = self._step_seconds(admitted)
            step_s = max(prefill_s, decode_s)
            # Fixed-rate steps: small lateness does not accumulate; a stall of a whole step
            # restarts the timeline instead of being made up in a burst.
            deadline += step_s
            if deadline < time.monotonic():
                deadline = time.monotonic() + step_s
                self._restarts += 1
            await asyncio.sleep(deadline - time.monotonic())
            self._late_s += time.monotonic() - deadline
            self._steps += 1
            decoded = self._decode()
            for entry in admitted:
                entry.emitted = 1
            self._tokens += decoded + len(admitted)
            if self._log is not None:
                if admitted:
                    self._log.prefill([len(e.item.input_ids) for e in admitted], len(self._running), len(self._waiting), prefill_s)
                if self._running:
                    self._log.decode(len(self._running), decoded, decode_s, len(self._waiting))
            still: list[_Running] = []
            for entry in [*self._running, *admitted]:
                if entry.emitted < len(entry.output.output_ids):
                    still.append(entry)
                else:
                    self._finish(entry)
            self._running = still

    def _decode(self) -> int:
        """One decode step of the running requests: the tokens it yields."""
        total = 0
        for entry in self._running:
            tokens = 1
            if self._speculation is not None:
                accepted = min(self._speculation.accepted(self._rng), len(entry.output.output_ids) - entry.emitted - 1)
                entry.hist[accepted] += 1
                entry.verify_ct += 1
                tokens += accepted
            entry.emitted += tokens
            total += tokens
        return total

    def _finish(self, entry: _Running) -> None:
        if entry.future.done():
            return
        out = entry.output
        if self._speculation is not None:
            out.meta_extra = self._speculation.meta_info(len(out.output_ids), entry.verify_ct, entry.hist)
        entry.future.set_result(out)

    def stats(self) -> dict[str, Any]:
        return {
            "prefill_s": self._times.prefill_s,
            "decode_s": self._times.decode_s,
            "max_batch": self._max_batch,
            "requests": self._requests,
            "steps": self._steps,
            "tokens": self._tokens,
            "running": len(self._running),
            "waiting": len(self._waiting),
            "max_running": self._max_running,
            "max_waiting": self._max_waiting,
            "late_s": self._late_s,
            "timeline_restarts": self._restarts,
            "launch_factor": self._launch_factor,
        }

    async def close(self) -> None:
        if self._stepper is not None:
            self._stepper.cancel()
        for entry in [*self._running, *self._waiting]:
            if not entry.future.done():
                entry.future.cancel()
