"""P1: how close the `sglang` engine keeps a continuous-batching server to its ideal throughput,
and how many requests per second the client sustains on its own.

(a) throughput against a simulated server (per-step latency, max batch B) at concurrency B; the
    ideal, tail included, is computed exactly (`ideal_steps`). Goal: >= 0.97 of it.
(b) raw overhead: sustained requests/s through generate() against a zero-latency server (1-token
    outputs). Goal: >= 2,000 req/s on 2 cores.
(c) work sent twice under a mild fault mix (FAULT_MIX and periodic 503 blips, three servers):
    HTTP requests sent per request beyond 1 + faults/requests is finished work thrown away. Goal:
    none. Set-up and figures: BENCHMARKS.md, P1.

    .venv/bin/python benchmarks/p1_sglang_client.py            # all parts, default parameters
    .venv/bin/python benchmarks/p1_sglang_client.py --part a --step-ms 20 --batch 64 --requests 512
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import os
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.config import EngineConfig  # noqa: E402
from tasks.engines.base import GenerationRequest, GenerationResult, SamplingParams  # noqa: E402
from tasks.engines.sglang_client import SGLangEngine  # noqa: E402
from tasks.standins.server import ServerProcess  # noqa: E402
from tasks.standins.sim import plan_completion  # noqa: E402


def make_requests(n: int, prompt_len: int, max_new: int, tag: str) -> list[GenerationRequest]:
    prompt = tuple(range(10, 10 + prompt_len))
    return [
        GenerationRequest(hashlib.sha256(f"{tag}-{i}".encode()).hexdigest(), f"p{i}", 0, prompt,
                          SamplingParams(max_new_tokens=max_new))
        for i in range(n)
    ]


def ideal_steps(lengths: list[int], slots: int) -> int:
    """Makespan in steps of list scheduling: each free slot takes the next request at once."""
    free_at = [0] * min(slots, len(lengths))
    heapq.heapify(free_at)
    end = 0
    for n in lengths:
        start = heapq.heappop(free_at)
        heapq.heappush(free_at, start + n)
        end = max(end, start + n)
    return end


def server_stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/_stats", timeout=10) as resp:
        return json.loads(resp.read())


def set_fault(url: str, **spec: Any) -> None:
    req = urllib.request.Request(url + "/_fault", data=json.dumps(spec).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        resp.read()


def engine_for(url: str, concurrency: int) -> SGLangEngine:
    return SGLangEngine(EngineConfig(kind="sglang", endpoints=[url], concurrency_per_server=concurrency))


def part_a(
    step_ms: float, batch: int, n: int, max_new: int, prompt_len: int, concurrency: int | None = None
) -> dict[str, Any]:
    concurrency = concurrency or batch
    requests = make_requests(n, prompt_len, max_new, "a")
    lengths = [plan_completion(r.request_id, max_new).n_tokens for r in requests]
    total_tokens = sum(lengths)
    steps = ideal_steps(lengths, batch)
    ideal_s = steps * step_ms / 1000.0
    with ServerProcess(["--simulate", "--step-latency-ms", str(step_ms), "--max-batch", str(batch)]) as srv:
        with engine_for(srv.url, concurrency) as engine:
            got: list[GenerationResult] = []
            t0 = time.perf_counter()
            engine.generate(requests, got.append)  # type: ignore[arg-type]
            wall = time.perf_counter() - t0
        stats = server_stats(srv.url)["backend"]
    out_tokens = sum(o.completion_tokens for o in got)
    assert out_tokens == total_tokens and len(got) == n, "outcomes do not match the plan"
    return {
        "step_ms": step_ms, "max_batch": batch, "client_concurrency": concurrency, "requests": n,
        "max_new_tokens": max_new, "prompt_tokens": prompt_len, "output_tokens": total_tokens,
        "mean_output_tokens": total_tokens / n,
        "ideal_steps": steps, "ideal_s": ideal_s, "no_tail_bound_s": total_tokens / batch * step_ms / 1000,
        "wall_s": wall, "server_steps": stats["steps"],
        "achieved_tok_s": total_tokens / wall, "ideal_tok_s": total_tokens / ideal_s,
        "fraction_of_ideal": ideal_s / wall,
        "step_efficiency": steps / stats["steps"],
        "server_timeline_restarts": stats["timeline_restarts"],
        "server_batch_occupancy": stats["tokens"] / (stats["steps"] * batch),
    }


def part_b(n: int, concurrency: int, prompt_len: int, warmup: int) -> dict[str, Any]:
    count = 0

    def sink(o: object) -> None:
        nonlocal count
        count += isinstance(o, GenerationResult)

    with ServerProcess(["--simulate", "--step-latency-ms", "0"]) as srv, engine_for(srv.url, concurrency) as engine:
        engine.generate(make_requests(warmup, prompt_len, 1, "warm"), lambda o: None)
        t0 = time.perf_counter()
        engine.generate(make_requests(n, prompt_len, 1, "b"), sink)
        wall = time.perf_counter() - t0
    assert count == n, f"{n - count} requests did not succeed"
    return {"requests": n, "client_concurrency": concurrency, "prompt_tokens": prompt_len,
            "max_new_tokens": 1, "wall_s": wall, "requests_per_s": n / wall}


# (c)'s background faults, one per server: (mode, rate, extra spec fields).
FAULT_MIX = [("5xx", 0.01, {}), ("reset", 0.01, {}), ("timeout", 0.005, {"delay_s": 5.0})]


def part_c(n: int, step_ms: float, max_new: int, prompt_len: int, blip_every_s: float, blip_s: float) -> dict[str, Any]:
    """Sends per request under FAULT_MIX plus periodic 503 blips; see the module docstring."""
    args = ["--simulate", "--step-latency-ms", str(step_ms), "--max-batch", "32"]
    servers = [ServerProcess(args) for _ in FAULT_MIX]
    try:
        def background(i: int) -> None:
            mode, rate, extra = FAULT_MIX[i]
            set_fault(servers[i].url, mode=mode, rate=rate, seed=i + 1, **extra)

        for i in range(len(servers)):
            background(i)
        stop = threading.Event()
        blips: list[int] = []
        probe_faults = 0  # faults a blip put on health probes: no /generate to re-send

        def probes(url: str) -> int:
            counts = server_stats(url)["requests"]
            return sum(v for k, v in counts.items() if k != "generate")

        def blipper() -> None:
            nonlocal probe_faults
            k = 0
            while not stop.wait(blip_every_s):
                i = k % len(servers)
                before = probes(servers[i].url)
                set_fault(servers[i].url, mode="5xx", scope="all")  # new requests and probes fail
                time.sleep(blip_s)
                background(i)
                probe_faults += probes(servers[i].url) - before
                blips.append(i)
                k += 1

        cfg = EngineConfig(
            kind="sglang", endpoints=[s.url for s in servers], concurrency_per_server=16,
            request_timeout_s=2.0, backoff_base_s=0.05, backoff_max_s=0.5, health_recheck_s=1.0,
        )  # fmt: skip
        requests = make_requests(n, prompt_len, max_new, "c")
        got: list[Any] = []
        thread = threading.Thread(target=blipper, daemon=True)
        with SGLangEngine(cfg) as engine:
            thread.start()
            t0 = time.perf_counter()
            engine.generate(requests, got.append)
            wall = time.perf_counter() - t0
            stop.set()
            thread.join()
        stats = [server_stats(s.url) for s in servers]
    finally:
        for s in servers:
            s.stop()
    ok = sum(isinstance(o, GenerationResult) for o in got)
    assert len({o.request_id for o in got}) == len(got) == n, "a request lacks an outcome or has two"
    sent = sum(st["generate_requests"] for st in stats)
    injected = sum(st["faults"]["injected"] for st in stats) - probe_faults  # on /generate
    return {
        "requests": n, "ok": ok, "dead": n - ok, "wall_s": wall, "blips": len(blips),
        "sent": sent, "faults_injected": injected, "sent_per_request": sent / n,
        "floor_per_request": (n + injected) / n, "thrown_away": sent - n - injected,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["a", "b", "c", "both", "all"], default="all", help="both: a and b")
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--requests", type=int, default=512, help="part a: number of requests")
    p.add_argument("--concurrency", type=int, default=None, help="part a: client concurrency (default: --batch)")
    p.add_argument("--max-new", type=int, default=128, help="part a: max_new_tokens")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--raw-requests", type=int, default=20000, help="part b: number of requests")
    p.add_argument("--raw-concurrency", type=int, default=64)
    p.add_argument("--fault-requests", type=int, default=2000, help="part c: number of requests")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    a = p.parse_args(argv)
    print(f"P1 sglang client benchmark (cpus={os.cpu_count()}, python {sys.version.split()[0]})")
    results: dict[str, Any] = {}
    if a.part in ("a", "both", "all"):
        r = results["a"] = part_a(a.step_ms, a.batch, a.requests, a.max_new, a.prompt_len, a.concurrency)
        print(f"(a) continuous batching: step {r['step_ms']:g} ms, max batch {r['max_batch']}, "
              f"client concurrency {r['client_concurrency']}, {r['requests']} requests, "
              f"max_new_tokens {r['max_new_tokens']} (mean {r['mean_output_tokens']:.1f} out tokens)")
        print(f"    ideal {r['ideal_steps']} steps = {r['ideal_s']:.2f} s "
              f"(no-tail bound {r['no_tail_bound_s']:.2f} s); wall {r['wall_s']:.2f} s, "
              f"server ran {r['server_steps']} steps")
        print(f"    achieved {r['achieved_tok_s']:.0f} tok/s of ideal {r['ideal_tok_s']:.0f} tok/s "
              f"= {r['fraction_of_ideal']:.3f} of ideal (goal >= 0.97); "
              f"server batch occupancy {r['server_batch_occupancy']:.3f}")
        print(f"    step efficiency (ideal steps / steps the server ran) {r['step_efficiency']:.3f}; "
              f"server timeline restarts (fell a whole step behind) {r['server_timeline_restarts']}")
    if a.part in ("b", "both", "all"):
        r = results["b"] = part_b(a.raw_requests, a.raw_concurrency, a.prompt_len, warmup=1000)
        print(f"(b) raw client overhead: zero-latency server, {r['requests']} requests, "
              f"concurrency {r['client_concurrency']}, {r['prompt_tokens']}-token prompts, 1-token outputs")
        print(f"    {r['requests_per_s']:.0f} requests/s sustained ({r['wall_s']:.2f} s; goal >= 2000)")
    if a.part in ("c", "all"):
        r = results["c"] = part_c(a.fault_requests, 10.0, 64, a.prompt_len, blip_every_s=4.0, blip_s=0.3)
        print(f"(c) mild fault mix: 3 simulated servers (10 ms steps), {r['requests']} requests, "
              f"0.5-1% background faults, {r['blips']} blips of 503s")
        print(f"    {r['sent']} HTTP requests sent = {r['sent_per_request']:.4f} per request "
              f"(floor 1 + faults/requests = {r['floor_per_request']:.4f}: {r['faults_injected']} faults); "
              f"{r['thrown_away']} re-sent though not failed (goal 0); {r['ok']} ok, {r['dead']} dead, "
              f"{r['wall_s']:.1f} s")
    if a.json is not None:
        a.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
