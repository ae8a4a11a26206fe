"""SGLang's simulated acceptance: `SGLANG_SIMULATE_ACC_LEN=X` (an environment variable of 0.5.14,
`speculative/spec_utils.py`) makes a speculative server run its real draft and verify pipeline but
accept a forced number of tokens per verify, with a mean of about X, whatever the draft proposed.
Its tok/s is what a draft of accept length X would get on that server; its outputs are not the
target's (the verify's predictions are filled with token 100), so such a launch says nothing about
output agreement.

`SGLANG_SIMULATE_ACC_METHOD` picks the draw, once per verify of the batch (at concurrency 1, per
request cycle): "multinomial" (the default) rounds a normal draw of mean X and sd 1 clamped to
[1, num_steps + 1], so its mean drifts from X near the bounds; "match-expected" takes floor(X) or
floor(X) + 1 with the weights that make the mean X. The gate sets the variable (the break-even
launches, tasks/gate/breakeven.py); the emulator honours it the same way.
"""

from __future__ import annotations

import math
import random

SIMULATE_ACC_LEN = "SGLANG_SIMULATE_ACC_LEN"
SIMULATE_ACC_METHOD = "SGLANG_SIMULATE_ACC_METHOD"
METHODS = ("multinomial", "match-expected")
SIMULATED_TOKEN = 100  # what the verify's predictions are filled with under simulation


def simulated_tokens(rng: random.Random, mean: float, num_steps: int, method: str = "multinomial") -> int:
    """Tokens one verify yields under simulation (accepted drafts + the bonus token), in [1, num_steps + 1]."""
    if method not in METHODS:
        raise ValueError(f"{SIMULATE_ACC_METHOD} {method!r} is not one of {METHODS}")
    top = num_steps + 1
    if method == "multinomial":
        return int(round(min(max(rng.gauss(mean, 1.0), 1.0), top)))
    x = min(max(mean, 1.0), float(top))
    lower = math.floor(x)
    return lower + 1 if lower < top and rng.random() < x - lower else lower
