"""The SGLang simulator: one continuous-batching timing model with a plain and a speculative
behaviour, behind the stand-in server (`serve-sglang --simulate`) and the launch emulator.

Scheduling: at most `max_batch` requests run and the rest queue; a request that arrives during
a step joins at the next step boundary, as with a real scheduler. The step that admits a request
prefills it and yields its first token; every later step decodes: one token per running request
(plain) or a verify cycle's accepted draft tokens plus one (speculative). A step takes the longer
of its prefill and decode parts, scaled by a per-launch and a per-request speed factor.

Load: a target forward costs `batch_token_s` more per token it processes, so a plain decode of B
requests takes decode_s + batch_token_s * B and a verify of B requests at n draft tokens each
verify_step_s + (verify_token_s + batch_token_s) * n * B, plus its draft steps (draft_step_s +
draft_batch_token_s * B each): speculation that pays alone stops paying in a big batch, as on a
real GPU once the step is compute-bound. With an `AdaptiveRuntime` (sim_adaptive.py) the draft
steps of each verify follow the batch size as SGLang's adaptive speculation picks them; at steps 0
the step is still a cycle of the speculative pipeline (a verify of one token per request and the
draft's extend over it, counted as a verify that accepted nothing), slower than a plain server's
decode, as SGLang 0.5.14's was (0.66x a plain server at concurrency 8, BENCHMARKS P32). The speculative behaviour
and SGLang's scheduler log lines live in sim_spec.py.

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
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from tasks.sglang.simulated_acceptance import SIMULATED_TOKEN
from tasks.standins.backends import BackendInput, BackendOutput
from tasks.standins.sim_adaptive import AdaptiveRuntime
from tasks.standins.sim_spec import SchedulerLog, Speculation

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


# --- the two behaviours (the speculative one: sim_spec.py) -------------------------------------


@dataclass(frozen=True)
class StepTimes:
    prefill_s: float  # a step that prefills (and yields the first token of) newly admitted requests
    decode_s: float  # a plain decode step of one request
    # Added to a target forward per token it processes (a plain decode: one per running request):
    # the step stops being memory-bound as the batch grows.
    batch_token_s: float = 0.0

    def plain_decode_s(self, batch: int) -> float:
        return self.decode_s + self.batch_token_s * batch


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
    """Continuous batching over `StepTimes`, plain or (with a `Speculation`) speculative; with an
    `AdaptiveRuntime` the step count of each verify follows the batch size (SGLang's adaptive
    speculation), steps 0 being the pipeline's cycle without draft steps."""

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
        adaptive: AdaptiveRuntime | None = None,
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
        self._adaptive = adaptive if speculation is not None else None
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
        if self._times.prefill_s == self._times.decode_s == self._times.batch_token_s == 0 and self._speculation is None:
            self._tokens += sum(len(o.output_ids) for o in outputs)
            return outputs
        if self._stepper is None:
            self._wake = asyncio.Event()
            self._stepper = asyncio.create_task(self._step_forever())
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        entries = [_Running(i, o, loop.create_future(), self._hist_size()) for i, o in zip(items, outputs, strict=True)]
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

    def _hist_size(self) -> int:
        """Accept-histogram slots: 0..the most draft steps a verify of this launch can run."""
        spec = self._speculation
        if spec is None:
            return 0
        return max(spec.num_steps, self._adaptive.max_steps if self._adaptive is not None else 0) + 1

    def _step_seconds(self, admitted: list[_Running]) -> tuple[float, float, int]:
        """(prefill part, decode part, draft steps) of the next step; the step takes the longer
        part. An adaptive server picks the draft steps for this batch size here, as SGLang's
        worker does before it drafts, and a switch of steps costs its graph swap."""
        prefill = self._times.prefill_s if admitted else 0.0
        batch = len(self._running)
        spec, steps = self._speculation, 0
        if spec is not None:
            steps = spec.num_steps if self._adaptive is None or not batch else self._adaptive.activate(batch)
        if not batch:
            decode = 0.0
        elif spec is not None:  # an adaptive tier at steps 0 still runs the speculative pipeline
            decode = spec.cycle_s(batch, steps, self._times.batch_token_s)
        else:
            decode = self._times.plain_decode_s(batch)
        if self._adaptive is not None:
            decode += self._adaptive.take_switch_s()
        # The batch moves at its slowest request's pace.
        factor = self._launch_factor * max(e.factor for e in [*self._running, *admitted])
        return prefill * factor, decode * factor, steps

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
            prefill_s, decode_s, steps = self._step_seconds(admitted)
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
            decoded = self._decode(steps)
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

    def _decode(self, steps: int) -> int:
        """One decode step of the running requests at `steps` draft steps: the tokens it yields.
        A speculative step of 0 draft steps (an adaptive tier with speculation off) counts as a
        verify that accepted nothing: the emulator's assumption, spec_verify_ct counting every
        decode step of a speculative server."""
        total = 0
        drawn: list[int] = []  # accepted drafts per request, before the answer's end cuts them
        for entry in self._running:
            tokens = 1
            if self._speculation is not None:
                drawn.append(self._speculation.accepted(self._rng, steps))
                accepted = min(drawn[-1], len(entry.output.output_ids) - entry.emitted - 1)
                entry.hist[accepted] += 1
                entry.verify_ct += 1
                tokens += accepted
            entry.emitted += tokens
            total += tokens
        if self._adaptive is not None and drawn:
            self._adaptive.on_verify(drawn, len(drawn))
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
            **(self._adaptive.stats() if self._adaptive is not None else {}),
        }

    async def close(self) -> None:
        if self._stepper is not None:
            self._stepper.cancel()
        for entry in [*self._running, *self._waiting]:
            if not entry.future.done():
                entry.future.cancel()
