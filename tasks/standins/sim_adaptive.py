"""SGLang's batch-size-aware adaptive speculation (0.5.14, 0.5.23) as the emulator runs it.

What is imitated (read from 0.5.14's speculative/adaptive_spec_params.py, adaptive_runtime_state.py,
arg_groups/speculative_hook.py and eagle_worker_v2.py); the config's parse and routing rules are
eaglescale's own, tasks/sglang/adaptive.py, used here as they are:

- Server args: a launch that cannot adapt (an algorithm other than EAGLE/EAGLE3, topk > 1) logs
  "speculative_adaptive disabled: ..." and runs static. Otherwise the config file (or SGLang's
  default tiers) is read as SGLang reads it: keys of digits are tiers, the knobs are shared, every
  other key is skipped silently; a tier whose candidate_steps is not a non-empty list of
  non-negative ints, or a file with no tier, fails start-up with SGLang's ValueError. The launch's
  --speculative-num-steps must be one of the tiers' candidates; draft tokens become steps + 1.
- The worker: one slot per tier, starting at the launch's steps when they are among the tier's
  candidates (else at its middle candidate), its EMA of accepted drafts at steps - 1; a runtime
  state (graphs) per candidate step, each logged as built.
- Every decode step: the batch size, padded to the speculative decode CUDA-graph batch sizes (none
  with graphs off), picks its tier; the worker switches to that slot's steps when they differ.
  After the verify the slot's EMA takes the batch's mean accepted drafts (not at steps 0) and,
  after `warmup_batches`, every `update_interval` batches moves the slot among its candidates
  (drop and rise thresholds with hysteresis, an optional ceiling); a move switches the worker.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tasks.sglang.adaptive import DEFAULT_TIERS, KNOBS, AdaptiveConfig, spec_graph_batch_sizes
from tasks.standins.sim_spec import sglang_log

# SGLang's knob defaults (AdaptiveStepSlot) and its default config's per-tier hysteresis (its
# DEFAULT_ADAPTIVE_CONFIG: the first tier keeps the default drop hysteresis, the others none).
KNOB_DEFAULTS: dict[str, float] = {"ema_alpha": 0.2, "update_interval": 5, "warmup_batches": 10,
                                   "down_hysteresis": -0.25, "up_hysteresis": 0.0, "ceiling_coeff": 0}  # fmt: skip
_DEFAULT_TIER_KNOBS: dict[int, dict[str, float]] = {
    1: {"up_hysteresis": 0.0, "down_hysteresis": -0.25, "ceiling_coeff": 0},
    **{tier: {"up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0} for tier in (8, 32, 64)},
}
# The decode CUDA graphs' largest batch when --cuda-graph-max-bs-decode is not given: SGLang's
# choice for an 80 GB GPU at tp < 4.
DEFAULT_GRAPH_MAX_BS = 256
ADAPTIVE_ALGORITHMS = ("EAGLE", "EAGLE3")


def unsupported_reason(algorithm: str | None, topk: int | None) -> str | None:
    """Why SGLang would run this launch static despite --speculative-adaptive (the reasons the
    emulator can meet: it has no dp-attention, multi-layer EAGLE, TBO or PD-multiplexing)."""
    if algorithm not in ADAPTIVE_ALGORITHMS:
        return f"speculative_algorithm={algorithm} (only EAGLE/EAGLE3 are supported)"
    if topk is not None and topk != 1:
        return f"speculative_eagle_topk={topk} (only topk=1 is supported)"
    return None


def _default_raw() -> dict[str, Any]:
    return {str(t): {"candidate_steps": list(s), **_DEFAULT_TIER_KNOBS.get(t, {})} for t, s in DEFAULT_TIERS.items()}


def _as_sglang_reads(raw: Any) -> dict[str, Any]:
    """The part of the file SGLang reads: digit keys (tiers; in each, candidate_steps and the
    knobs) and the shared knobs. SGLang skips every other key without a word, so the emulator
    does too, before eaglescale's stricter parse sees the file."""
    if not isinstance(raw, Mapping):  # SGLang calls .items() on it
        raise AttributeError(f"'{type(raw).__name__}' object has no attribute 'items'")
    kept: dict[str, Any] = {}
    for key, entry in raw.items():
        if key.isdigit():
            if not isinstance(entry, Mapping):  # SGLang calls .get() on it
                raise AttributeError(f"'{type(entry).__name__}' object has no attribute 'get'")
            kept[key] = {k: v for k, v in entry.items() if k == "candidate_steps" or k in KNOBS}
        elif key in KNOBS:
            kept[key] = entry
    return kept


def _check_as_sglang(raw: Mapping[str, Any], kept: Mapping[str, Any]) -> None:
    """SGLang's own start-up checks, with its messages (its _load_adaptive_config)."""
    tiers = [k for k in kept if k.isdigit()]
    for key in tiers:
        steps = kept[key].get("candidate_steps")
        if not isinstance(steps, list) or not steps or not all(isinstance(s, int) and s >= 0 for s in steps):
            raise ValueError(f"BS {key}: candidate_steps must be a list of non-negative ints, got {steps!r}")
    if not tiers:
        raise ValueError(
            "speculative_adaptive_config must contain at least one integer-string BS key, e.g. "
            f'{{"1": {{"candidate_steps": [1,3,7]}}}}. Got keys: {list(raw)}'
        )


@dataclass(frozen=True)
class AdaptivePlan:
    """What an adaptive launch runs: its tiers, each tier's knobs (shared ones overridden by the
    tier's own), the step count it starts at and the graph batch sizes batches are padded to."""

    config: AdaptiveConfig
    tier_knobs: dict[int, dict[str, float]]
    initial_steps: int
    graph_batch_sizes: list[int] | None

    @property
    def max_steps(self) -> int:
        return max(self.config.candidate_steps)


def plan_adaptive(path: str | None, num_steps: int | None, graph_max_bs: int | None) -> AdaptivePlan:
    """SGLang's start-up of an adaptive launch that can adapt. Raises what SGLang raises: OSError
    or a JSON error for an unreadable file, ValueError for a config it refuses or a num_steps
    outside the candidates. `graph_max_bs` None: CUDA graphs off (no padding)."""
    if path is None:
        raw: Any = _default_raw()
    else:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    kept = _as_sglang_reads(raw)
    _check_as_sglang(raw, kept)
    config = AdaptiveConfig.parse(kept, path or "default adaptive config")
    candidates = config.candidate_steps
    steps = candidates[len(candidates) // 2] if num_steps is None else num_steps
    if steps not in candidates:
        raise ValueError(f"--speculative-num-steps={steps} is not in the adaptive config candidate_steps {candidates}. "
                         "Pass one of those values.")  # fmt: skip
    shared = {k: v for k, v in kept.items() if k in KNOBS}
    knobs = {tier: {**shared, **{k: v for k, v in kept[str(tier)].items() if k in KNOBS}} for tier in config.tiers}
    graph_bs = None if graph_max_bs is None else spec_graph_batch_sizes(graph_max_bs)
    return AdaptivePlan(config, knobs, steps, graph_bs)


@dataclass
class StepSlot:
    """One tier's step count, moved among its candidates by an EMA of accepted drafts per request
    (SGLang's AdaptiveStepSlot: the behaviour the emulator imitates)."""

    candidates: list[int]
    knobs: dict[str, float]
    current: int
    ema: float
    batches: int = 0

    @classmethod
    def start(cls, initial_steps: int, candidates: tuple[int, ...], knobs: Mapping[str, float]) -> StepSlot:
        steps = sorted(candidates)
        current = initial_steps if initial_steps in steps else steps[len(steps) // 2]
        return cls(steps, {**KNOB_DEFAULTS, **knobs}, current, float(current - 1))

    def update(self, accepted: list[int]) -> int | None:
        """Take one verify's accepted drafts per request; the old step count when it moved."""
        if not accepted:
            return None
        if self.current > 0:  # steps 0 drafts nothing: no acceptance to learn from
            alpha = self.knobs["ema_alpha"]
            self.ema = (1 - alpha) * self.ema + alpha * sum(accepted) / len(accepted)
        self.batches += 1
        past = self.batches - self.knobs["warmup_batches"]
        if past <= 0 or past % self.knobs["update_interval"]:
            return None
        old, self.current = self.current, self._target()
        return old if self.current != old else None

    def _target(self) -> int:
        steps, i = self.candidates, self.candidates.index(self.current)
        if self.current == 0:  # after a stretch without drafting, probe the next candidate up
            target = steps[min(i + 1, len(steps) - 1)]
            if target > 0 and self.ema < 0:  # never drafted: start the probe from a neutral EMA
                self.ema = float(target - 1)
            return target
        start = i
        while i > 0 and self.ema <= (0.5 if steps[i - 1] == 0 else steps[i - 1] - 0.5) + self.knobs["down_hysteresis"]:
            i -= 1
        if i == start:
            while i < len(steps) - 1 and self.ema > steps[i] - 0.5 + self.knobs["up_hysteresis"]:
                i += 1
        # The ceiling only holds a slot down: it never blocks a rise above the current steps.
        if self.knobs["ceiling_coeff"] > 0 and steps[i] <= self.current:
            ceiling = max(1, math.ceil(self.ema * self.knobs["ceiling_coeff"]))
            while i > 0 and steps[i] > ceiling:
                i -= 1
        return steps[i]


@dataclass
class AdaptiveRuntime:
    """The worker's side: the step count in effect, a slot per tier, switches (each adding
    `switch_s`, the emulator's graph-swap cost, to the first step run at the new count) and
    SGLang's log lines."""

    plan: AdaptivePlan
    rank: bool = True
    switch_s: float = 0.0
    steps: int = field(init=False)
    switches: int = field(default=0, init=False)
    _slots: dict[int, StepSlot] = field(init=False)
    _pending_s: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        p = self.plan
        self.steps = p.initial_steps
        self._slots = {t: StepSlot.start(p.initial_steps, c, p.tier_knobs.get(t, {})) for t, c in p.config.tiers.items()}

    @property
    def max_steps(self) -> int:
        return self.plan.max_steps

    def log_init(self) -> None:
        """The worker's first line: the smallest tier's slot."""
        first = self._slots[min(self._slots)]
        sglang_log(f"AdaptiveSpeculativeParams initialized: steps={first.current}, candidate_steps={first.candidates}", self.rank)

    def log_states_built(self) -> None:
        """A runtime state per candidate step; the launch's own was built with the worker."""
        for steps in self.plan.config.candidate_steps:
            if steps != self.plan.initial_steps:
                sglang_log(f"Built adaptive runtime state steps={steps}: elapsed=0.50s, mem=0.10GB", self.rank)

    def _route(self, batch: int) -> StepSlot:
        return self._slots[self.plan.config.tier_for(batch, self.plan.graph_batch_sizes)]

    def activate(self, batch: int) -> int:
        """The step count a decode of `batch` requests runs at (switching to it first)."""
        self._switch(self._route(batch).current)
        return self.steps

    def on_verify(self, accepted: list[int], batch: int) -> None:
        slot = self._route(batch)
        old = slot.update(accepted)
        if old is not None:
            sglang_log(f"Adaptive spec params updated: steps {old} -> {slot.current} (ema_accept_len={slot.ema:.2f})", self.rank)
            self._switch(slot.current)

    def _switch(self, steps: int) -> None:
        if steps == self.steps:
            return
        sglang_log(f"Switch adaptive runtime state: steps {self.steps} -> {steps}, "
                   f"draft_tokens {self.steps + 1} -> {steps + 1}", self.rank)  # fmt: skip
        self.steps = steps
        self.switches += 1
        self._pending_s += self.switch_s

    def take_switch_s(self) -> float:
        """The swap cost owed by the step about to run (switched before it or after the last)."""
        owed, self._pending_s = self._pending_s, 0.0
        return owed

    def stats(self) -> dict[str, Any]:
        return {"adaptive_steps": self.steps, "adaptive_switches": self.switches,
                "adaptive_slots": {str(t): s.current for t, s in self._slots.items()}}  # fmt: skip
