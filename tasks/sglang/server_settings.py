"""The SGLang server settings of a run (`gate.server`): one model for the gate's launches, an
operator's launch and the generation server's.

Each field is one flag of SGLang's launch_server; tasks/sglang/versions.py holds which flag and
which pinned versions have it, and refuses a set field for a version that lacks it. It lives with
SGLang's launch interface, below the configuration: the command builder (tasks/sglang/command.py)
takes it, and the gate's config section (tasks/config/gate_section.py) holds one. Were it in the
configuration package, the builder would import upward and the two packages would form a circle.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ServerSettings(BaseModel):
    """Server-wide SGLang settings, applied alike to every launch built from them: the gate's
    baseline and speculative launches (`gate.server`), an operator's launch through
    `python -m tasks.sglang.command` / infra/sglang/launch_speculative.sh, and the generation server
    of infra/sglang/launch_target.sh. Unset (None / false) means SGLang's own default: nothing is
    emitted. A set field is emitted only for SGLang versions known to have its flag, and refused
    (naming the flag and the version) for the others.

    What the H200 node's SGLang 0.5.14 bundle needs (measured on the project's H200: BENCHMARKS.md P8):
    attention_backend triton (no FA3 kernels; FA3 is Hopper's default), sampling_backend pytorch,
    grammar_backend none, skip_tokenizer_init, dtype bfloat16, disable_prefill_cuda_graph.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    attention_backend: str | None = Field(
        None, description="--attention-backend, e.g. triton (the H200 bundle has no FA3 kernels)."
    )
    sampling_backend: str | None = Field(
        None, description="--sampling-backend, e.g. pytorch (flashinfer's kernels are not needed)."
    )
    grammar_backend: str | None = Field(
        None, description="--grammar-backend, e.g. none (no constrained decoding is used)."
    )
    skip_tokenizer_init: bool = Field(
        False,
        description="--skip-tokenizer-init: the server loads no tokenizer; requests must send "
        "input_ids (ours do) and answers carry no \"text\".",
    )
    dtype: str | None = Field(None, description="--dtype, e.g. bfloat16.")
    disable_prefill_cuda_graph: bool = Field(
        False,
        description="--disable-prefill-cuda-graph: no prefill graph capture (36 s of a server's "
        "start-up on the H200); decode speed, what the gate measures, does not depend on it.",
    )
    sleep_on_idle: bool = Field(False, description="--sleep-on-idle: no busy polling while idle.")
    disable_radix_cache: bool = Field(
        False,
        description="--disable-radix-cache: no prefix cache; each request's KV freed when it ends. For a "
        "generation server whose prompts share little: with the cache, finished requests fill the KV pool, "
        "then every admission evicts first, and SGLang 0.5.14's eviction heaps every cached leaf each call "
        "(generation slowed to ~0.58x from there: BENCHMARKS.md P16).",
    )
    max_total_tokens: int | None = Field(None, ge=1, description="--max-total-tokens (KV pool size).")
    max_running_requests: int | None = Field(None, ge=1, description="--max-running-requests.")
    random_seed: int | None = Field(None, ge=0, description="--random-seed.")
