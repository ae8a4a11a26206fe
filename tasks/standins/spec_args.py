"""SGLang's launch_server CLI as the emulator parses it, per pinned version, and the server-args
rules for speculation that change what runs (the running-request cap, adaptive speculation)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from tasks.sglang.adaptive import (
    ADAPTIVE_CONFIG_FLAG,
    ADAPTIVE_FLAG,
    ADAPTIVE_VERSIONS,
    SPEC_DEFAULT_MAX_RUNNING,
)
from tasks.sglang.recorded_flags import recorded_flags
from tasks.standins.sim_adaptive import (
    DEFAULT_GRAPH_MAX_BS,
    AdaptivePlan,
    plan_adaptive,
    unsupported_reason,
)
from tasks.standins.sim_spec import sglang_log

# A plain server's running-request cap without --max-running-requests: SGLang derives it from the
# KV pool (thousands on an H100); a load level never queues on it.
PLAIN_MAX_RUNNING = 4096


@dataclass
class LaunchArgs:
    """The subset of SGLang's server args the emulator reads (names as in ServerArgs)."""

    model_path: str
    host: str
    port: int
    tp_size: int
    speculative_algorithm: str | None
    speculative_draft_model_path: str | None
    speculative_num_steps: int | None
    speculative_eagle_topk: int | None
    speculative_num_draft_tokens: int | None
    cuda_graph_max_bs: int | None
    disable_cuda_graph: bool
    disable_prefill_cuda_graph: bool
    max_running_requests: int | None
    max_total_tokens: int | None
    mem_fraction_static: float | None
    context_length: int | None
    skip_tokenizer_init: bool
    attention_backend: str | None
    sampling_backend: str | None
    grammar_backend: str | None
    dtype: str | None
    sleep_on_idle: bool
    random_seed: int | None
    nccl_port: int | None = None  # bound for the server's life, as torch.distributed's store is
    speculative_adaptive: bool = False  # 0.5.14 and later; False once SGLang falls back to static
    speculative_adaptive_config: str | None = None


ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM")
# The server settings the emulator reads (tasks/sglang/server_settings.py's ServerSettings; the gate's builder emits them).
_SETTING_VALUES = ("--attention-backend", "--sampling-backend", "--grammar-backend", "--dtype")
_SETTING_SWITCHES = ("--skip-tokenizer-init", "--sleep-on-idle")


def _sglang_parser(version: str) -> argparse.ArgumentParser:
    """argparse as the pinned version's launch_server has it, for the flags the emulator reads;
    with a recorded --help (0.5.14) every other flag it lists is accepted (and ignored) too, and
    choices are the recorded ones, so a command SGLang would refuse is refused here."""
    recorded = recorded_flags(version)
    choices = recorded.choices if recorded is not None else {}
    p = argparse.ArgumentParser(prog="sglang.launch_server (emulated)", allow_abbrev=False)
    p.add_argument("--model-path", "--model", dest="model_path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--nccl-port", type=int, default=None)
    tp_aliases = ("--tp-size", "--tensor-parallel-size") if recorded is not None else ("--tp-size", "--tp")
    p.add_argument(*tp_aliases, dest="tp_size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--speculative-algorithm", choices=ALGORITHMS, default=None)
    p.add_argument("--speculative-draft-model-path", default=None)
    p.add_argument("--speculative-num-steps", type=int, default=None)
    p.add_argument("--speculative-eagle-topk", type=int, default=None)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--log-level", default="info")
    p.add_argument("--random-seed", type=int, default=None)
    for flag in _SETTING_VALUES:
        p.add_argument(flag, default=None, choices=choices.get(flag))
    for flag in _SETTING_SWITCHES:
        p.add_argument(flag, action="store_true")
    p.set_defaults(disable_prefill_cuda_graph=False, speculative_adaptive=False, speculative_adaptive_config=None)
    if version in ADAPTIVE_VERSIONS:  # 0.5.4 refuses them (exit 2) as an unknown flag
        p.add_argument(ADAPTIVE_FLAG, dest="speculative_adaptive", action="store_true")
        p.add_argument(ADAPTIVE_CONFIG_FLAG, dest="speculative_adaptive_config", default=None)
    if version == "0.5.4":
        p.add_argument("--cuda-graph-max-bs", dest="cuda_graph_max_bs", type=int, default=None)
        p.add_argument("--disable-cuda-graph", dest="disable_cuda_graph", action="store_true")
    else:
        p.add_argument("--cuda-graph-max-bs-decode", dest="cuda_graph_max_bs", type=int, default=None)
        p.add_argument("--disable-decode-cuda-graph", dest="disable_cuda_graph", action="store_true")
        p.add_argument("--disable-prefill-cuda-graph", action="store_true")
    if version == "0.5.14":
        # The deprecated aliases still work there (SGLang warns); the gate's builder never emits them.
        p.add_argument("--cuda-graph-max-bs", dest="cuda_graph_max_bs", type=int, default=None)
        p.add_argument("--disable-cuda-graph", dest="deprecated_disable_cuda_graph", action="store_true")
    if recorded is not None:
        taken = {o for action in p._actions for o in action.option_strings}
        for flag in sorted(recorded.flags - taken):
            p.add_argument(flag, nargs="*", dest=f"ignored_{flag.lstrip('-').replace('-', '_')}",
                           choices=None if flag not in choices else [*choices[flag]])  # fmt: skip
    return p


def parse_launch_args(version: str, argv: list[str]) -> LaunchArgs:
    """Parse as SGLang's argparse would (unknown flags exit 2); apply SGLang's spec rules."""
    a = _sglang_parser(version).parse_args(argv)
    if getattr(a, "deprecated_disable_cuda_graph", False):  # 0.5.14: both phases, as SGLang maps it
        a.disable_cuda_graph = a.disable_prefill_cuda_graph = True
    args = LaunchArgs(**{f.name: getattr(a, f.name) for f in fields(LaunchArgs)})
    spec = (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens)
    if args.speculative_algorithm is not None and (None in spec and spec != (None, None, None)):
        raise SystemExit(f"AssertionError: set all of num_steps/eagle_topk/num_draft_tokens or none, got {spec}")
    return args


def resolve_server_args(a: LaunchArgs) -> AdaptivePlan | None:
    """SGLang's server-args rules for speculation that change what runs (its speculative hook):
    adaptive speculation checked and planned (sim_adaptive.py; raises what SGLang raises), then
    a speculative server's running-request cap of 48 unless --max-running-requests is given."""
    plan = None
    if a.speculative_adaptive:
        reason = unsupported_reason(a.speculative_algorithm, a.speculative_eagle_topk)
        if reason is not None:
            sglang_log(f"speculative_adaptive disabled: {reason}. Falling back to static speculative params.", rank=False)
            a.speculative_adaptive = False
        else:
            graph_max_bs = None if a.disable_cuda_graph else a.cuda_graph_max_bs or DEFAULT_GRAPH_MAX_BS
            plan = plan_adaptive(a.speculative_adaptive_config, a.speculative_num_steps, graph_max_bs)
            a.speculative_eagle_topk = a.speculative_eagle_topk or 1
            a.speculative_num_steps = plan.initial_steps
            a.speculative_num_draft_tokens = plan.initial_steps + 1
    if a.speculative_algorithm is not None and a.max_running_requests is None:
        a.max_running_requests = SPEC_DEFAULT_MAX_RUNNING
        sglang_log(f"Max running requests is reset to {SPEC_DEFAULT_MAX_RUNNING} for speculative decoding. "
                   "You can override this by explicitly setting --max-running-requests.", rank=False)  # fmt: skip
    return plan


def max_running(a: LaunchArgs) -> int:
    """The running-request cap in effect (a speculative server's is set by resolve_server_args)."""
    return a.max_running_requests or PLAIN_MAX_RUNNING
