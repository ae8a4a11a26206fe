"""SGLang's batch-size-aware adaptive speculation, as 0.5.14 runs it: what eaglescale writes into
`--speculative-adaptive-config FILE`, the checks 0.5.14 makes on that file, and how a server routes
a batch to a step count. The gate's serving policy (tasks/gate/serving_policy.py) writes these
files; the emulator (tasks/standins/) runs them as the real server does.

Facts, read from 0.5.14's `speculative/adaptive_spec_params.py`, `adaptive_runtime_state.py`,
`arg_groups/speculative_hook.py` and `server_args.py`:

- The JSON maps batch-size tiers to settings: every key made of digits alone is a tier (its batch
  size); every other key is a knob shared by all tiers (`ema_alpha`, `update_interval`,
  `warmup_batches`, `up_hysteresis`, `down_hysteresis`, `ceiling_coeff`) and SGLang skips any
  other one silently. A tier needs `candidate_steps`: a non-empty list of non-negative ints; 0
  turns speculation off for that tier. At least one tier must exist.
- Routing: a batch of B requests is padded to the next decode CUDA-graph batch size (B itself when
  none is as large), then takes the tier with the largest key at or below that size (the smallest
  tier when none is). Within a tier the step count moves among its candidates by an EMA of the
  accepted draft tokens per request (after `warmup_batches`, every `update_interval` batches); a
  tier with one candidate never moves.
- The server starts at `--speculative-num-steps`, which must be one of the union of the tiers'
  candidates (else start-up fails); num_draft_tokens becomes steps + 1. A CUDA graph is captured
  for every candidate step (at the graph batch sizes whose tier can reach it).
- Only EAGLE/EAGLE3 with topk 1, without dp-attention, multi-layer EAGLE, two-batch overlap or
  PD-multiplexing: otherwise the server logs "speculative_adaptive disabled: ..." and runs static.
- Drafting off (a tier at 0 steps) is not a plain server: the speculative pipeline still runs, a
  verify of one token a request and the draft's extend. Measured on the H200 (BENCHMARKS P32,
  random weights of Qwen2.5-1.5B's shape): 0.66x a plain server at concurrency 8, 0.36x at 64.
- Every speculative server of 0.5.14 caps running requests at 48 unless `--max-running-requests`
  is given ("Max running requests is reset to 48 for speculative decoding"); a plain server's cap
  comes from its KV pool.

eaglescale's own rule beyond 0.5.14's: a key that is neither a tier nor a known knob is refused,
since SGLang would ignore it (a tier written "8 " or "bs8" would silently not exist).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ADAPTIVE_FLAG = "--speculative-adaptive"
ADAPTIVE_CONFIG_FLAG = "--speculative-adaptive-config"
# The versions whose launch_server has the two flags (0.5.14's recorded --help; 0.5.4 predates them).
ADAPTIVE_VERSIONS = ("0.5.14", "0.5.23")
SPEC_DEFAULT_MAX_RUNNING = 48  # 0.5.14's running-request cap on a speculative server without the flag
KNOBS = ("ema_alpha", "update_interval", "warmup_batches", "up_hysteresis", "down_hysteresis", "ceiling_coeff")
# 0.5.14's default tiers (what `--speculative-adaptive` without a config file runs).
DEFAULT_TIERS: dict[int, tuple[int, ...]] = {1: (1, 3, 7), 8: (0, 1, 3), 32: (0, 1), 64: (0,)}


class AdaptiveConfigError(ValueError):
    """An adaptive config 0.5.14 would refuse, or one whose meaning it would silently change."""


@dataclass(frozen=True)
class AdaptiveConfig:
    """The tiers of an adaptive config: batch size -> candidate steps (sorted, distinct), and
    the shared knobs as written."""

    tiers: dict[int, tuple[int, ...]]
    knobs: dict[str, float]

    @classmethod
    def parse(cls, raw: Any, where: str = "adaptive config") -> AdaptiveConfig:
        """Check `raw` (the JSON's object) by 0.5.14's rules and eaglescale's stricter key rule."""
        if not isinstance(raw, Mapping):
            raise AdaptiveConfigError(f"{where}: must be a JSON object of batch-size tiers, got {type(raw).__name__}")
        tiers: dict[int, tuple[int, ...]] = {}
        knobs: dict[str, float] = {}
        for key, entry in raw.items():
            if not isinstance(key, str):
                raise AdaptiveConfigError(f"{where}: key {key!r} is not a string")
            if key.isdigit():
                tiers[int(key)] = _candidates(entry, f"{where}: tier {key!r}")
            elif key in KNOBS:
                knobs[key] = _knob(entry, f"{where}: {key}")
            else:
                raise AdaptiveConfigError(
                    f"{where}: key {key!r} is neither a batch-size tier (an integer string such as \"8\") nor one of "
                    f"{list(KNOBS)}; SGLang 0.5.14 would ignore it silently"
                )
        if not tiers:
            raise AdaptiveConfigError(f"{where}: no batch-size tier (an integer-string key such as \"1\"), got keys {list(raw)}")
        return cls(dict(sorted(tiers.items())), knobs)

    @classmethod
    def load(cls, path: str) -> AdaptiveConfig:
        with open(path, encoding="utf-8") as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as e:
                raise AdaptiveConfigError(f"{path}: not JSON: {e}") from None
        return cls.parse(raw, path)

    def to_json(self) -> dict[str, Any]:
        """The file's object: tiers as integer-string keys (ascending), then the knobs."""
        out: dict[str, Any] = {str(b): {"candidate_steps": list(s)} for b, s in self.tiers.items()}
        out.update(self.knobs)
        return out

    @property
    def candidate_steps(self) -> list[int]:
        """The union of the tiers' candidates: what the server captures graphs for."""
        return sorted({s for steps in self.tiers.values() for s in steps})

    def initial_num_steps(self) -> int | None:
        """The `--speculative-num-steps` a launch of this config starts at: the smallest tier's
        step when it has one candidate and speculates, else its highest positive candidate, else
        the highest positive step of any tier. None when no tier speculates (a plain server)."""
        first = self.tiers[min(self.tiers)]
        positive = [s for s in first if s > 0] or [s for s in self.candidate_steps if s > 0]
        return max(positive) if positive else None

    def tier_for(self, batch: int, graph_batch_sizes: Sequence[int] | None) -> int:
        """The tier (its key) a batch of `batch` requests runs in: padded to the next graph batch
        size, then the largest tier at or below it."""
        padded = pad_to_graph(batch, graph_batch_sizes)
        keys = list(self.tiers)
        return keys[max(0, bisect.bisect_right(keys, padded) - 1)]

    def fixed_steps(self, batch: int, graph_batch_sizes: Sequence[int] | None) -> int | None:
        """The step count at `batch` when its tier has one candidate (no EMA movement), else None."""
        steps = self.tiers[self.tier_for(batch, graph_batch_sizes)]
        return steps[0] if len(steps) == 1 else None


def _candidates(entry: Any, where: str) -> tuple[int, ...]:
    if not isinstance(entry, Mapping):
        raise AdaptiveConfigError(f"{where}: must be an object with candidate_steps, got {entry!r}")
    unknown = sorted(set(entry) - {"candidate_steps", *KNOBS})
    if unknown:
        raise AdaptiveConfigError(f"{where}: unknown keys {unknown} (SGLang 0.5.14 reads candidate_steps and {list(KNOBS)})")
    steps = entry.get("candidate_steps")
    if not isinstance(steps, list) or not steps or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps):
        raise AdaptiveConfigError(f"{where}: candidate_steps must be a non-empty list of non-negative ints, got {steps!r}")
    for knob in set(entry) & set(KNOBS):
        _knob(entry[knob], f"{where}: {knob}")
    return tuple(sorted(set(steps)))


def _knob(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise AdaptiveConfigError(f"{where} must be a number, got {value!r}")
    return value


def spec_graph_batch_sizes(max_bs: int) -> list[int]:
    """The decode CUDA-graph batch sizes 0.5.14 captures for a speculative server whose
    `--cuda-graph-max-bs-decode` is `max_bs` (server_args._generate_decode_cuda_graph_batch_sizes)."""
    sizes = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8), *range(272, max_bs + 1, 16)]
    sizes = [b for b in sizes if b <= max_bs]
    return sizes if max_bs in sizes else [*sizes, max_bs]


def pad_to_graph(batch: int, graph_batch_sizes: Sequence[int] | None) -> int:
    if not graph_batch_sizes:
        return batch
    sizes = sorted(graph_batch_sizes)
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else batch


def tiers_from_levels(steps_by_level: Mapping[int, int]) -> dict[int, tuple[int, ...]]:
    """One-candidate tiers that run `steps_by_level[L]` at every measured load level L and, between
    two levels, the higher level's steps (the more loaded, so the more cautious choice): a tier
    starts at 1 and at each previous level + 1 where the steps change. With every level a
    speculative graph batch size (1, 2, 4, ... are), a padded batch lands in the intended tier."""
    if not steps_by_level:
        raise AdaptiveConfigError("no load level to build tiers from")
    levels = sorted(steps_by_level)
    if levels[0] < 1 or any(s < 0 for s in steps_by_level.values()):
        raise AdaptiveConfigError(f"levels must be >= 1 and steps >= 0, got {dict(steps_by_level)}")
    tiers: dict[int, tuple[int, ...]] = {1: (steps_by_level[levels[0]],)}
    for prev, level in zip(levels, levels[1:], strict=False):
        if steps_by_level[level] != steps_by_level[prev]:
            tiers[prev + 1] = (steps_by_level[level],)
    return tiers


def vllm_schedule(steps_by_level: Mapping[int, int], max_batch: int) -> list[list[int]]:
    """The same policy as vLLM's `num_speculative_tokens_per_batch_size`: inclusive batch-size
    ranges [lo, hi, K] from 1 to `max_batch` (K = 0: speculation off), K taken as in the tiers."""
    tiers = tiers_from_levels(steps_by_level)
    starts = sorted(tiers)
    ends = [s - 1 for s in starts[1:]] + [max(max_batch, starts[-1])]
    return [[lo, hi, tiers[lo][0]] for lo, hi in zip(starts, ends, strict=True)]
