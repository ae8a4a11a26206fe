"""`python -m tasks.engines.sglang_spec_launch [--sim-config-json J] SGLANG_ARGS`: the SGLang
launch emulator's command line (see sglang_spec_sim.py for what it emulates).

It parses SGLANG_ARGS as the pinned version's `sglang.launch_server` would (unknown flags exit 2;
0.5.23 refuses --cuda-graph-max-bs), applies SGLang's speculative-argument rules, logs the
start-up (weights, CUDA-graph captures) in SGLang's format and serves on --host/--port.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from dataclasses import asdict, fields

from tasks.engines.sglang_app import SGLangCompatServer
from tasks.engines.sglang_server import start_site
from tasks.engines.sglang_spec_sim import LaunchArgs, SpecSimBackend, SpecSimConfig, sglang_log

ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM")


def _sglang_parser(version: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglang.launch_server (emulated)", allow_abbrev=False)
    p.add_argument("--model-path", "--model", dest="model_path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", "--tp", dest="tp_size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
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
    if version == "0.5.4":
        p.add_argument("--cuda-graph-max-bs", dest="cuda_graph_max_bs", type=int, default=None)
        p.add_argument("--disable-cuda-graph", dest="disable_cuda_graph", action="store_true")
    else:
        p.add_argument("--cuda-graph-max-bs-decode", dest="cuda_graph_max_bs", type=int, default=None)
        p.add_argument("--disable-decode-cuda-graph", dest="disable_cuda_graph", action="store_true")
    return p


def parse_launch_args(version: str, argv: list[str]) -> LaunchArgs:
    """Parse as SGLang's argparse would (unknown flags exit 2); apply SGLang's spec rules."""
    a = _sglang_parser(version).parse_args(argv)
    args = LaunchArgs(**{f.name: getattr(a, f.name) for f in fields(LaunchArgs)})
    spec = (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens)
    if args.speculative_algorithm is not None and (None in spec and spec != (None, None, None)):
        raise SystemExit(f"AssertionError: set all of num_steps/eagle_topk/num_draft_tokens or none, got {spec}")
    return args


def _capture(version: str, kind: str, a: LaunchArgs, hang: bool = False) -> bool:
    """Log a CUDA-graph capture in the version's wording; False (no end line) when it hangs.

    0.5.4: model_runner's "Capture cuda graph begin" and the EAGLE worker's "Capture draft
    [extend ]cuda graph begin". Newer (cuda_graph_setup): "Capture target verify|decode CUDA
    graph begin. backend=..., num_tokens_per_req=..., bs=[...], avail mem=..."."""
    if version == "0.5.4":
        label = {"target": "", "draft": "draft ", "draft_extend": "draft extend "}[kind]
        begin = f"Capture {label}cuda graph begin. This can take up to several minutes. avail mem=70.00 GB"
        end = f"Capture {label}cuda graph end. Time elapsed: 0.01 s. mem usage=0.50 GB. avail mem=69.50 GB."
    else:
        spec = a.speculative_algorithm is not None
        label = {"target": "target verify" if spec else "target decode", "draft": "draft decode",
                 "draft_extend": "draft extend"}[kind]  # fmt: skip
        per_req = (a.speculative_num_draft_tokens or 1) if kind == "target" else 1
        begin = (f"Capture {label} CUDA graph begin. backend=full, num_tokens_per_req={per_req}, "
                 f"bs={[b for b in (1, 2, 4, 8) if b <= (a.cuda_graph_max_bs or 8)]}, avail mem=70.00 GB")  # fmt: skip
        end = f"Capture {label} CUDA graph end. elapsed=0.01 s, mem usage=0.50 GB, avail mem=69.50 GB."
    sglang_log(begin)
    if hang:
        return False
    sglang_log(end)
    return True


def startup_log(cfg: SpecSimConfig, a: LaunchArgs) -> None:
    sglang_log(f"server_args=ServerArgs({', '.join(f'{k}={v!r}' for k, v in asdict(a).items())})", rank=False)
    if a.speculative_eagle_topk == 1 and a.speculative_num_draft_tokens != (a.speculative_num_steps or 0) + 1:
        sglang_log("speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when speculative_eagle_topk == 1", rank=False)
        a.speculative_num_draft_tokens = (a.speculative_num_steps or 0) + 1
    sglang_log("Load weight begin. avail mem=79.00 GB")
    sglang_log("Load weight end. type=LlamaForCausalLM, dtype=torch.bfloat16, avail mem=71.00 GB, mem usage=8.00 GB.")
    if a.speculative_algorithm is not None:
        sglang_log("Load weight end. type=LlamaForCausalLMEagle3, dtype=torch.bfloat16, avail mem=70.50 GB, mem usage=0.50 GB.")
    if not a.disable_cuda_graph:
        if not _capture(cfg.sglang_version, "target", a, hang=cfg.never_healthy):
            return
        if a.speculative_algorithm is not None:
            if (a.speculative_num_steps or 0) > 1:  # SGLang captures no draft graph for one step
                _capture(cfg.sglang_version, "draft", a)
            _capture(cfg.sglang_version, "draft_extend", a)
    sglang_log(f"max_total_num_tokens=100000, max_running_requests={a.max_running_requests or 1}, context_len=32768")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tasks.engines.sglang_spec_sim", add_help=False, allow_abbrev=False)
    p.add_argument("--sim-config-json", default="{}", help="SpecSimConfig fields as JSON")
    p.add_argument("--sim-launch-index", type=int, default=0, help="seeds this launch's speed factor")
    return p


async def _serve(cfg: SpecSimConfig, args: LaunchArgs, launch_index: int) -> None:
    startup_log(cfg, args)
    server = SGLangCompatServer(SpecSimBackend(cfg, args, launch_index))
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


def main(argv: list[str] | None = None) -> int:
    sim, rest = _parser().parse_known_args(argv)
    try:
        cfg = SpecSimConfig.from_dict(json.loads(sim.sim_config_json))
    except (ValueError, TypeError) as e:
        print(f"sglang_spec_sim: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        args = parse_launch_args(cfg.sglang_version, rest)
    except SystemExit as e:  # argparse's usage error (already printed) or a spec-args error
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr, flush=True)
        return 2 if e.code else 0
    if cfg.max_topk is not None and (args.speculative_eagle_topk or 1) > cfg.max_topk:
        sglang_log(f"RuntimeError: speculative_eagle_topk {args.speculative_eagle_topk} > 1 is not supported "
                   "by this attention backend", rank=False)  # fmt: skip
        return 1
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(cfg, args, sim.sim_launch_index))
    return 0


if __name__ == "__main__":
    sys.exit(main())
