"""The emulated target's distribution, and SGLang's logprob fields built from it.

The simulator has no model: an output is a key-seeded stream of ids (sim.py). For the gate's
lossless rule (tasks/gate/lossless.py) it still needs what a real target has at every position,
the top tokens and their logprobs, so this gives each position a deterministic synthetic one,
anchored to the token there: that token is the argmax, the runner-up trails it by a margin, and
further ranks fall off geometrically. A fraction `near_tie_rate` of positions are near-ties (a
margin of 0.02-0.3 nats, well inside the 0.625 a bf16 target's paths can disagree by, BENCHMARKS
P13); the others are confident (3-8 nats). Everything derives from (seed, key, position): two launches of one
seed agree on which positions are near-ties and on every runner-up, as two launches of a real
target do, so a speculative launch that flips a near-tie emits exactly the runner-up the
baseline's re-score then reports.

Served as SGLang 0.5.x does (its scheduler and tokenizer manager): with return_logprob,
`input_token_logprobs` has one [logprob, id, null] per input token from logprob_start_len on
(the first logprob null), `output_token_logprobs` one per generated token (and their count,
`output_token_logprobs_length`); with
top_logprobs_num K > 0 also `input_top_logprobs` (first entry null) and `output_top_logprobs`,
K entries each, best first. The key of an input position is the input up to
logprob_start_len + 1, taken as the prompt: what the gate's re-score sends
(logprob_start_len = len(prompt) - 1).

Where a speculative answer left the plain one (`deviation`), its own logprobs there are what its
verify forward would report: for a flipped near-tie (FLIP) the emitted runner-up first, ahead of
the plain token by under half a bf16 ulp of a 16-32 logit (the noise that flipped it); for a
change of output (CHANGE: a wrong verify, a penalty applied differently) the target's own
distribution, in which the emitted token is not first.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

NEAR_TIE_MARGIN = (0.02, 0.3)  # nats: near-ties
CONFIDENT_MARGIN = (3.0, 8.0)  # nats: every other position
FLIP_LEAD = 0.0625  # nats: at most this far ahead is the runner-up a verify flipped to (its own view)
FLIP, CHANGE = "flip", "change"  # a speculative answer's deviation: numerics, or a change of output


@dataclass(frozen=True)
class SyntheticDistribution:
    seed: int
    near_tie_rate: float
    vocab_size: int

    def _rng(self, kind: str, key: str, position: int) -> random.Random:
        return random.Random(f"{kind}:{self.seed}:{key}:{position}")

    def is_near_tie(self, key: str, position: int) -> bool:
        return self._rng("tie", key, position).random() < self.near_tie_rate

    def margin(self, key: str, position: int) -> float:
        """Nats between the argmax and the runner-up at `position` of `key`'s output."""
        low, high = NEAR_TIE_MARGIN if self.is_near_tie(key, position) else CONFIDENT_MARGIN
        return self._rng("margin", key, position).uniform(low, high)

    def top(self, key: str, position: int, token: int, k: int) -> list[tuple[int, float]]:
        """The k best (token, logprob) at `position`, best first, with `token` the argmax. The
        logprobs do not depend on k: the ranks' mass is fixed over an infinite geometric tail."""
        rng = self._rng("top", key, position)
        step = rng.uniform(0.5, 1.5)  # nats between successive ranks after the second
        mass = rng.uniform(0.85, 0.99)  # of the whole distribution, over all ranks
        second = math.exp(-self.margin(key, position))
        scale = mass / (1.0 + second + second * math.exp(-step) / (1.0 - math.exp(-step)))
        ids, seen = [token], {token}
        while len(ids) < k:
            t = 4 + rng.randrange(self.vocab_size - 4)
            if t not in seen:
                ids.append(t)
                seen.add(t)
        weights = [1.0, second] + [second * math.exp(-step * j) for j in range(1, k - 1)]
        return [(t, math.log(w * scale)) for t, w in zip(ids, weights[:k], strict=True)]

    def runner_up(self, key: str, position: int, token: int) -> int:
        return self.top(key, position, token, 2)[1][0]

    def flip_draw(self, key: str, position: int) -> float:
        """A uniform draw of (key, position): a speculative launch flips a near-tie below its rate."""
        return self._rng("flip", key, position).random()

    def deviated_top(self, key: str, position: int, plain: int, emitted: int, kind: str, k: int) -> list[tuple[int, float]]:
        """The k best (token, logprob) a speculative server's own forward reports where it
        emitted `emitted` in place of the plain token `plain` (module docstring): FLIP puts the
        emitted token first by a lead under FLIP_LEAD, CHANGE leaves the target's ranking."""
        top = self.top(key, position, plain, max(k, 2))
        if kind == CHANGE:
            return top[:k]
        lead = self._rng("lead", key, position).uniform(0.0, FLIP_LEAD)
        rest = [(t, lp) for t, lp in top if t not in (plain, emitted)]
        return [(emitted, top[0][1]), (plain, top[0][1] - lead), *rest][:k]


def logprob_fields(
    dist: SyntheticDistribution, key: str, input_ids: list[int], start: int, output_ids: list[int], top_n: int,
    deviation: tuple[int, int, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """SGLang's meta_info logprob fields for an answer (see the module docstring). Position i of
    the key's output is input position start + 1 + i; the generated tokens follow the input.
    `deviation`: (output position, the plain token there, FLIP or CHANGE) of a speculative answer
    that left the plain one there."""
    prompt_len = start + 1
    at = len(input_ids) - prompt_len + deviation[0] if deviation else None

    def ranked(position: int, token: int, k: int) -> list[tuple[int, float]]:
        if deviation is not None and position == at:
            return dist.deviated_top(key, position, deviation[1], token, deviation[2], k)
        return dist.top(key, position, token, k)

    def entry(position: int, token: int) -> list[Any]:
        top = ranked(position, token, max(top_n, 2))
        # The emitted token outside the reported top: below its last.
        return [next((lp for t, lp in top if t == token), top[-1][1] - 1.0), token, None]

    def tops(position: int, token: int) -> list[list[Any]]:
        return [[lp, t, None] for t, lp in ranked(position, token, top_n)]

    rest = range(prompt_len, len(input_ids))
    out = {
        "input_token_logprobs": [[None, input_ids[start], None]] + [entry(q - prompt_len, input_ids[q]) for q in rest],
        "output_token_logprobs": [entry(len(input_ids) - prompt_len + j, t) for j, t in enumerate(output_ids)],
        "output_token_logprobs_length": len(output_ids),  # 0.5.14 sends it beside them (the recorded answers)
    }
    if top_n > 0:
        out["input_top_logprobs"] = [None] + [tops(q - prompt_len, input_ids[q]) for q in rest]
        out["output_top_logprobs"] = [tops(len(input_ids) - prompt_len + j, t) for j, t in enumerate(output_ids)]
    return out
