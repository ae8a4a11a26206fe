"""`python -m tasks.standins.spec_launch [--sim-config-json J] SGLANG_ARGS`: the SGLang launch
emulator, the simulator (sim.py) started as SGLang is started.

The gate (tasks/gate/) launches `python -m sglang.launch_server ARGS` on GPU nodes; in CI and
dry runs it launches this module with the same ARGS, so the launch-command builder, the health
wait, the server-info check, the log parser and the benchmark protocol all run against a real
process over real HTTP.

What is emulated (field names and log formats read from SGLang's tokenizer manager, scheduler
metrics mixin and EAGLE worker):
- the CLI of the pinned version, parsed as its `sglang.launch_server` would (unknown flags exit
  2): 0.5.4 takes --cuda-graph-max-bs / --disable-cuda-graph, 0.5.23 takes
  --cuda-graph-max-bs-decode / --disable-decode-cuda-graph and rejects the old max-bs flag,
  0.5.14 takes exactly the flags of its recorded --help; with topk=1 a draft-token count other
  than steps+1 is silently adjusted, as SGLang does (a warning in the log, the adjusted value in
  server info);
- the start-up log in the version's wording (weights, CUDA-graph captures of the target and the
  draft and draft-extend graphs) and the server args echoed in server info;
- serving: the simulator keyed by prompt (baseline and speculative launches agree token for
  token unless `disagree_from` is set), speculative with --speculative-algorithm, at a per-launch
  and a per-request speed factor (the run-to-run spread), writing SGLang's scheduler log lines;
- load (sim.py): steps grow with the batch (`batch_token_s` per token a target forward processes,
  `draft_batch_token_s` per request a draft step carries), so a draft that wins at concurrency 1
  can lose at 16, as measured on an H100; --max-running-requests caps the running batch, and a
  speculative server without it is capped at 48 with SGLang's warning (a plain one at 4096, its
  KV pool's order); server info echoes the cap in effect;
- adaptive speculation (0.5.14, 0.5.23; 0.5.4 refuses the flags): --speculative-adaptive and
  --speculative-adaptive-config as SGLang starts and runs them (sim_adaptive.py): the config's
  checks and SGLang's messages, the fall-back to static for a tree, per-batch-size step counts
  moved by SGLang's EMA rule, their log lines, steps 0 as the speculative pipeline's cycle without drafts (slower than a plain decode, as on 0.5.14), `adaptive_switch_s` per
  switch; server info echoes speculative_adaptive (in effect) and speculative_adaptive_config.
Failure switches: `stuck_acceptance` (every draft rejected: the EAGLE-vs-EAGLE3 symptom),
`disagree_from`, `never_healthy` (hangs in CUDA-graph capture; /health_generate never passes),
`max_topk` (a tree config above it exits during start-up).

The lossless rule's evidence (tasks/gate/lossless.py): answers carry SGLang's logprob fields when
asked (return_logprob, logprob_start_len, top_logprobs_num), from the emulated target's synthetic
distribution (sim_logprobs.py: `near_tie_rate` of positions are near-ties). A speculative launch
flips `near_tie_flip_rate` of those near-ties to the runner-up, as a bf16 verify does; with
`wrong_token_from` it emits the runner-up at the first confident position from there on (a server
that changes output), and with a frequency penalty in the request it imitates SGLang's relaxed
penalty under speculation. `SGLANG_SIMULATE_ACC_LEN` (and `_METHOD`) in its environment force the
accept length as SGLang 0.5.14 does (tasks/sglang/simulated_acceptance.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from tasks.sglang.adaptive import ADAPTIVE_VERSIONS
from tasks.sglang.simulated_acceptance import METHODS, SIMULATE_ACC_LEN, SIMULATE_ACC_METHOD
from tasks.standins.app import SGLangCompatServer
from tasks.standins.backends import BackendInput, BackendOutput
from tasks.standins.server import start_site
from tasks.standins.sim import SimulatedBackend, StepTimes, launch_speed_factor, prompt_key
from tasks.standins.sim_adaptive import AdaptivePlan, AdaptiveRuntime
from tasks.standins.sim_logprobs import SyntheticDistribution, logprob_fields
from tasks.standins.sim_spec import SchedulerLog, Speculation, sglang_log
from tasks.standins.spec_args import LaunchArgs, max_running, parse_launch_args, resolve_server_args

EMULATED_VERSIONS = ("0.5.4", "0.5.14", "0.5.23")
_COSTS = ("batch_token_s", "draft_batch_token_s", "adaptive_switch_s")


@dataclass
class EmulatorConfig:
    """The emulated server's speed, acceptance and failure switches (the gate's `emulator`)."""

    sglang_version: str = "0.5.23"
    prefill_s: float = 0.001
    baseline_step_s: float = 0.002
    verify_step_s: float = 0.0025
    verify_token_s: float = 0.0  # added per draft token verified
    draft_step_s: float = 0.0003
    # Load: each token a target forward processes adds batch_token_s to it (a plain decode of B
    # requests: B tokens; a verify: B * draft tokens); each draft step adds draft_batch_token_s
    # per running request. 0: steps cost the same at every batch size.
    batch_token_s: float = 0.0
    draft_batch_token_s: float = 0.0
    adaptive_switch_s: float = 0.0  # added to the first step an adaptive server runs after switching steps
    accept_probs: list[float] = field(default_factory=lambda: [0.8, 0.7, 0.6, 0.5, 0.4])
    launch_jitter: float = 0.0  # stdev of the per-launch speed factor
    request_jitter: float = 0.0  # stdev of the per-request speed factor
    seed: int = 0
    vocab_size: int = 32000
    min_new_fraction: float = 0.5  # completions are at least this fraction of max_new_tokens
    decode_log_interval: int = 8
    disagree_from: int | None = None  # speculative outputs diverge from the baseline at this token
    stuck_acceptance: bool = False
    never_healthy: bool = False
    # A launch with --speculative-eagle-topk above this exits during start-up, as a server whose
    # attention backend has no tree-verify kernels would.
    max_topk: int | None = None
    near_tie_rate: float = 0.05  # positions of the synthetic target distribution that are near-ties
    near_tie_flip_rate: float = 0.0  # speculative launches emit the runner-up at this share of them
    wrong_token_from: int | None = None  # speculative launches emit the runner-up at a confident position

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EmulatorConfig:
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"sim config: unknown field(s) {unknown}")
        cfg = cls(**data)
        if cfg.sglang_version not in EMULATED_VERSIONS:
            raise ValueError(f"sim config: sglang_version {cfg.sglang_version!r} not in {EMULATED_VERSIONS}")
        if not cfg.accept_probs or not all(0.0 <= p <= 1.0 for p in cfg.accept_probs):
            raise ValueError(f"sim config: accept_probs must be probabilities, got {cfg.accept_probs}")
        for name in ("near_tie_rate", "near_tie_flip_rate"):
            if not 0.0 <= getattr(cfg, name) <= 1.0:
                raise ValueError(f"sim config: {name} must be in [0, 1], got {getattr(cfg, name)}")
        for name in _COSTS:
            if getattr(cfg, name) < 0:
                raise ValueError(f"sim config: {name} must be >= 0, got {getattr(cfg, name)}")
        return cfg


# 0.5.14's prefill graph sizes, as its log lists them (tests/fixtures/sglang-0.5.14/).
PREFILL_GRAPH_TOKENS = (
    [*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
     *range(1280, 4097, 256), *range(4608, 8193, 512)]
)  # fmt: skip
# Decode graph batch sizes: 1, 2, 4, 8, 12, then steps of 8 (0.5.14's baseline log, up to 256).
DECODE_GRAPH_BS = [1, 2, 4, 8, 12, *range(16, 257, 8)]


def _graph_bs(a: LaunchArgs) -> list[int]:
    top = a.cuda_graph_max_bs or 8
    if a.speculative_algorithm is not None:  # 0.5.14's EAGLE3 log: every size up to 8
        return sorted(set(range(1, min(top, 8) + 1)) | {b for b in DECODE_GRAPH_BS if b <= top})
    return [b for b in DECODE_GRAPH_BS if b <= top]


def _capture(version: str, kind: str, a: LaunchArgs, hang: bool = False) -> bool:
    """Log a CUDA-graph capture in the version's wording; False (no end line) when it hangs.

    0.5.4: model_runner's "Capture cuda graph begin" and the EAGLE worker's "Capture draft
    [extend ]cuda graph begin". 0.5.14 (recorded) and newer: "Capture target verify|decode|prefill
    CUDA graph begin. backend=..., num_tokens_per_bs=..., bs=[...], avail mem=...", "Capture draft
    decode|extend CUDA graph begin. ..."."""
    rank = _rank(version, a)
    if version == "0.5.4":
        label = {"target": "", "draft": "draft ", "draft_extend": "draft extend "}[kind]
        begin = f"Capture {label}cuda graph begin. This can take up to several minutes. avail mem=70.00 GB"
        end = f"Capture {label}cuda graph end. Time elapsed: 0.01 s. mem usage=0.50 GB. avail mem=69.50 GB."
    elif kind == "prefill":
        begin = f"Capture target prefill CUDA graph begin. backend=tc_piecewise, num_tokens={PREFILL_GRAPH_TOKENS}, avail mem=70.00 GB"
        end = "Capture target prefill CUDA graph end. elapsed=0.01 s, mem usage=0.40 GB, avail mem=69.60 GB."
    else:
        spec = a.speculative_algorithm is not None
        label = {"target": "target verify" if spec else "target decode", "draft": "draft decode",
                 "draft_extend": "draft extend"}[kind]  # fmt: skip
        steps, topk = a.speculative_num_steps or 0, a.speculative_eagle_topk or 1
        per_bs = {"target": a.speculative_num_draft_tokens or 1, "draft": topk, "draft_extend": steps + 1}[kind]
        key = "num_tokens_per_bs" if version == "0.5.14" else "num_tokens_per_req"
        begin = f"Capture {label} CUDA graph begin. backend=full, {key}={per_bs}, bs={_graph_bs(a)}, avail mem=70.00 GB"
        end = f"Capture {label} CUDA graph end. elapsed=0.01 s, mem usage=0.50 GB, avail mem=69.50 GB."
    sglang_log(begin, rank)
    if hang:
        return False
    sglang_log(end, rank)
    return True


def _rank(version: str, a: LaunchArgs) -> bool:
    """Whether scheduler lines carry " TP0": 0.5.14 on one GPU prints none (its recorded log)."""
    return version != "0.5.14" or a.tp_size > 1


def _target_architecture(model_path: str) -> str:
    """The model class SGLang would load: the folder's config.json says (Llama, Qwen2, ...)."""
    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
            return str((json.load(f).get("architectures") or ["LlamaForCausalLM"])[0])
    except (OSError, ValueError):
        return "LlamaForCausalLM"


def startup_log(cfg: EmulatorConfig, a: LaunchArgs, adaptive: AdaptiveRuntime | None = None) -> None:
    version, rank = cfg.sglang_version, _rank(cfg.sglang_version, a)
    echoed = {k: v for k, v in asdict(a).items() if version in ADAPTIVE_VERSIONS or not k.startswith("speculative_adaptive")}
    sglang_log(f"server_args=ServerArgs({', '.join(f'{k}={v!r}' for k, v in echoed.items())})", rank=False)
    if a.speculative_eagle_topk == 1 and a.speculative_num_draft_tokens != (a.speculative_num_steps or 0) + 1:
        sglang_log("speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when speculative_eagle_topk == 1", rank=False)
        a.speculative_num_draft_tokens = (a.speculative_num_steps or 0) + 1
    models = [_target_architecture(a.model_path)] + (["LlamaForCausalLMEagle3"] if a.speculative_algorithm is not None else [])
    for model in models:
        sglang_log("Load weight begin. avail mem=79.00 GB", rank)
        if version == "0.5.14":
            sglang_log(f"Load weight end. elapsed=0.10 s, type={model}, avail mem=71.00 GB, mem usage=8.00 GB.", rank)
        else:
            sglang_log(f"Load weight end. type={model}, dtype=torch.bfloat16, avail mem=71.00 GB, mem usage=8.00 GB.", rank)
    if adaptive is not None:  # the EAGLE worker's constructor
        adaptive.log_init()
    # 0.5.14 captures prefill graphs for a plain launch (its EAGLE3 log shows none).
    if version == "0.5.14" and a.speculative_algorithm is None and not a.disable_prefill_cuda_graph:
        _capture(version, "prefill", a)
    if not a.disable_cuda_graph:
        if not _capture(version, "target", a, hang=cfg.never_healthy):
            return
        if a.speculative_algorithm is not None:
            if (a.speculative_num_steps or 0) > 1:  # SGLang captures no draft graph for one step
                _capture(version, "draft", a)
            _capture(version, "draft_extend", a)
    if adaptive is not None:  # after the draft's graphs: a runtime state per other candidate step
        adaptive.log_states_built()
    sglang_log(f"max_total_num_tokens={a.max_total_tokens or 100000}, max_running_requests={max_running(a)}, "
               f"context_len={a.context_length or 32768}", rank)  # fmt: skip


class LaunchedSimulator(SimulatedBackend):
    """The simulator as a launched SGLang server: it echoes its server args in server info, logs
    cache flushes as SGLang does, and with `never_healthy` never finishes starting."""

    def __init__(self, cfg: EmulatorConfig, args: LaunchArgs, launch_index: int = 0,
                 adaptive: AdaptiveRuntime | None = None) -> None:  # fmt: skip
        self.distribution = SyntheticDistribution(cfg.seed, cfg.near_tie_rate, cfg.vocab_size)
        speculation = None
        if args.speculative_algorithm is not None:
            speculation = Speculation(
                cfg.sglang_version,
                num_steps=args.speculative_num_steps or 0,
                topk=args.speculative_eagle_topk or 1,
                num_draft_tokens=args.speculative_num_draft_tokens or 1,
                accept_probs=cfg.accept_probs,
                draft_step_s=cfg.draft_step_s,
                verify_step_s=cfg.verify_step_s,
                verify_token_s=cfg.verify_token_s,
                draft_batch_token_s=cfg.draft_batch_token_s,
                stuck_acceptance=cfg.stuck_acceptance,
                disagree_from=cfg.disagree_from,
                distribution=self.distribution,
                near_tie_flip_rate=cfg.near_tie_flip_rate,
                wrong_token_from=cfg.wrong_token_from,
                simulate_acc_len=simulated_accept_length(),
                simulate_method=os.environ.get(SIMULATE_ACC_METHOD, "multinomial"),
            )
        log = SchedulerLog(
            cfg.sglang_version,
            rank=_rank(cfg.sglang_version, args),
            decode_log_interval=cfg.decode_log_interval,
            # 0.5.14's recorded EAGLE3 prefill ran without a graph.
            prefill_graph=not (speculation is not None or args.disable_prefill_cuda_graph or args.disable_cuda_graph),
            decode_graph=not args.disable_cuda_graph,
            speculation=speculation,
        )
        super().__init__(
            times=StepTimes(prefill_s=cfg.prefill_s, decode_s=cfg.baseline_step_s, batch_token_s=cfg.batch_token_s),
            max_batch=max_running(args),
            context_length=args.context_length or 32768,
            vocab_size=cfg.vocab_size,
            model_path=args.model_path,
            outputs_follow_prompt=True,
            min_new_fraction=cfg.min_new_fraction,
            speculation=speculation,
            adaptive=adaptive,
            log=log,
            launch_factor=launch_speed_factor(cfg.seed, launch_index, cfg.launch_jitter),
            request_jitter=cfg.request_jitter,
            seed=f"requests:{cfg.seed}:{launch_index}",
        )
        self.cfg = cfg
        self.args = args

    def server_info_extra(self) -> dict[str, Any]:
        a = self.args
        old = self.cfg.sglang_version == "0.5.4"
        return {
            "version": self.cfg.sglang_version,
            "model_path": a.model_path,
            "tp_size": a.tp_size,
            "speculative_algorithm": a.speculative_algorithm,
            "speculative_draft_model_path": a.speculative_draft_model_path,
            "speculative_num_steps": a.speculative_num_steps,
            "speculative_eagle_topk": a.speculative_eagle_topk,
            "speculative_num_draft_tokens": a.speculative_num_draft_tokens,
            ("cuda_graph_max_bs" if old else "cuda_graph_max_bs_decode"): a.cuda_graph_max_bs,
            ("disable_cuda_graph" if old else "disable_decode_cuda_graph"): a.disable_cuda_graph,
            **({} if old else {"disable_prefill_cuda_graph": a.disable_prefill_cuda_graph}),
            **({"speculative_adaptive": a.speculative_adaptive, "speculative_adaptive_config": a.speculative_adaptive_config}
               if self.cfg.sglang_version in ADAPTIVE_VERSIONS else {}),
            "skip_tokenizer_init": a.skip_tokenizer_init,
            "attention_backend": a.attention_backend,
            "sampling_backend": a.sampling_backend,
            "grammar_backend": a.grammar_backend,
            "dtype": a.dtype or "auto",
            "sleep_on_idle": a.sleep_on_idle,
            "max_total_tokens": a.max_total_tokens,
            "random_seed": a.random_seed,
            "eaglescale_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
        }

    async def generate(self, items: list[BackendInput]) -> list[BackendOutput]:
        if self.cfg.never_healthy:
            raise RuntimeError("the scheduler is still capturing CUDA graphs")
        outputs = await super().generate(items)
        for item, out in zip(items, outputs, strict=True):
            if item.logprobs is not None:
                lp = item.logprobs
                key = prompt_key(item.input_ids[: lp.start + 1])
                fields_ = logprob_fields(self.distribution, key, item.input_ids, lp.start, out.output_ids, lp.top_n,
                                         out.deviation)  # fmt: skip
                out.meta_extra = {**fields_, **out.meta_extra}
        return outputs

    def flush_cache(self) -> None:
        sglang_log("Cache flushed successfully!")


def simulated_accept_length() -> float | None:
    """SGLANG_SIMULATE_ACC_LEN as SGLang reads it (a float; -1, its default, or unset: off)."""
    raw = os.environ.get(SIMULATE_ACC_LEN)
    if raw is None:
        return None
    value = float(raw)  # SGLang refuses a non-float the same way: at start-up
    return value if value > 0 else None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tasks.standins.spec_launch", add_help=False, allow_abbrev=False)
    p.add_argument("--sim-config-json", default="{}", help="EmulatorConfig fields as JSON")
    p.add_argument("--sim-launch-index", type=int, default=0, help="seeds this launch's speed factor")
    return p


def bind_nccl_port(args: LaunchArgs) -> socket.socket | None:
    """Listen on --nccl-port as SGLang's torch.distributed store does, for the server's life: two
    launches given one port fail as SGLang does (EADDRINUSE, before serving)."""
    if args.nccl_port is None:
        return None
    store = socket.socket()
    try:
        store.bind((args.host, args.nccl_port))
    except OSError:
        store.close()
        sglang_log("torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
                   f"network address. port: {args.nccl_port}, useIpv6: false, code: -98, name: EADDRINUSE, "
                   "message: address already in use", rank=False)  # fmt: skip
        raise SystemExit(1) from None
    store.listen()
    return store


async def _serve(cfg: EmulatorConfig, args: LaunchArgs, launch_index: int, plan: AdaptivePlan | None) -> None:
    store = bind_nccl_port(args)
    rank = _rank(cfg.sglang_version, args)
    adaptive = None if plan is None else AdaptiveRuntime(plan, rank=rank, switch_s=cfg.adaptive_switch_s)
    startup_log(cfg, args, adaptive)
    backend = LaunchedSimulator(cfg, args, launch_index, adaptive)
    server = SGLangCompatServer(backend, skip_tokenizer_init=args.skip_tokenizer_init)
    runner, url = await start_site(server, args.host, args.port)
    sglang_log(f"Uvicorn running on {url} (Press CTRL+C to quit)", rank=False)
    if not cfg.never_healthy:
        sglang_log("The server is fired up and ready to roll!", rank=False)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        if store is not None:
            store.close()


def main(argv: list[str] | None = None) -> int:
    sim, rest = _parser().parse_known_args(argv)
    try:
        cfg = EmulatorConfig.from_dict(json.loads(sim.sim_config_json))
    except (ValueError, TypeError) as e:
        print(f"spec_launch: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        args = parse_launch_args(cfg.sglang_version, rest)
    except SystemExit as e:  # argparse's usage error (already printed) or a spec-args error
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr, flush=True)
        return 2 if e.code else 0
    if os.environ.get(SIMULATE_ACC_METHOD, "multinomial") not in METHODS:
        print(f"ValueError: {SIMULATE_ACC_METHOD} must be one of {METHODS}", file=sys.stderr, flush=True)
        return 1
    try:
        simulated_accept_length()
    except ValueError:
        print(f'ValueError: "{os.environ[SIMULATE_ACC_LEN]}" is not a valid float value', file=sys.stderr, flush=True)
        return 1
    try:
        plan = resolve_server_args(args)
    except (OSError, ValueError, AttributeError) as e:  # SGLang's server args raise; the process exits
        sglang_log(f"{type(e).__name__}: {e}", rank=False)
        return 1
    if cfg.max_topk is not None and (args.speculative_eagle_topk or 1) > cfg.max_topk:
        sglang_log(f"RuntimeError: speculative_eagle_topk {args.speculative_eagle_topk} > 1 is not supported "
                   "by this attention backend", rank=False)  # fmt: skip
        return 1
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(cfg, args, sim.sim_launch_index, plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
