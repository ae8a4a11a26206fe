"""The emulated target's distribution, and SGLang's logprob fields built from it.

The simulator has no model: an output is a key-seeded stream of ids (sim.py). For the gate's
lossless rule (tasks/gate/lossless.py) it still needs what a real target has at every position,
the top tokens and their logprobs, so this gives each position a deterministic synthetic one,
anchored to the token there: that token is the argmax, the runner-up trails it by a margin, and
further ranks fall off geometrically. A fraction `near_tie_rate` of positions are near-ties (a
margin of 0.02-0.3 nats, well inside the 0.5 a bf16 target's paths can disagree by); the others
are confident (3-8 nats). Everything derives from (seed, key, position): two launches of one
seed agree on which positions are near-ties and on every runner-up, as two launches of a real
target do, so a speculative launch that flips a near-tie emits exactly the runner-up the
baseline's re-score then reports.

Served as SGLang 0.5.x does (its scheduler and tokenizer manager): with return_logprob,
`input_token_logprobs` has one [logprob, id, null] per input token from logprob_start_len on
(the first logprob null), `output_token_logprobs` one per generated token; with
top_logprobs_num K > 0 also `input_top_logprobs` (first entry null) and `output_top_logprobs`,
K entries each, best first. The key of an input position is the input up to
logprob_start_len + 1, taken as the prompt: what the gate's re-score sends
(logprob_start_len = len(prompt) - 1).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

NEAR_TIE_MARGIN = (0.02, 0.3)  # nats: near-ties
CONFIDENT_MARGIN = (3.0, 8.0)  # nats: every other position


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


def logprob_fields(
    dist: SyntheticDistribution, key: str, input_ids: list[int], start: int, output_ids: list[int], top_n: int
) -> dict[str, Any]:
    """SGLang's meta_info logprob fields for an answer (see the module docstring). Position i of
    the key's output is input position start + 1 + i; the generated tokens follow the input."""
    prompt_len = start + 1

    def entry(position: int, token: int) -> list[Any]:
        return [dist.top(key, position, token, 1)[0][1], token, None]

    def tops(position: int, token: int) -> list[list[Any]]:
        return [[lp, t, None] for t, lp in dist.top(key, position, token, top_n)]

    rest = range(prompt_len, len(input_ids))
    out = {
        "input_token_logprobs": [[None, input_ids[start], None]] + [entry(q - prompt_len, input_ids[q]) for q in rest],
        "output_token_logprobs": [entry(len(input_ids) - prompt_len + j, t) for j, t in enumerate(output_ids)],
    }
    if top_n > 0:
        out["input_top_logprobs"] = [None] + [tops(q - prompt_len, input_ids[q]) for q in rest]
        out["output_top_logprobs"] = [tops(len(input_ids) - prompt_len + j, t) for j, t in enumerate(output_ids)]
    return out
