"""The SGLang emulator under load: the batch cost model (a target step stops being memory-bound as
the batch grows, so a draft that wins at concurrency 1 loses at 16), the running-request cap and
0.5.14's batch-size-aware adaptive speculation. Real emulator processes over real HTTP, driven by
N closed-loop clients."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from tasks.sglang.command import LaunchSpec
from tasks.sglang.server_process import (
    LaunchedServer,
    fetch_server_info,
    free_port,
    launch,
    wait_healthy,
)
from tasks.standins.sim_adaptive import AdaptivePlan, AdaptiveRuntime, StepSlot, plan_adaptive

ROOT = Path(__file__).resolve().parents[1]
MAX_NEW = 32
# Every completion exactly MAX_NEW tokens (min_new_fraction 1), so loads compare like for like.
# At B running requests: a plain step 2 + 0.2 B ms; a 3-step chain's cycle 3 (0.3 + 0.05 B) +
# 2.5 + 0.2 * 4 B ms for ~2.7 tokens per request (accept 0.8, 0.7, 0.6). B = 1: 455 vs ~620
# tok/s (x1.36); B = 16: 3077 vs ~2320 tok/s (x0.75).
LOAD = {"prefill_s": 0.001, "baseline_step_s": 0.002, "verify_step_s": 0.0025, "draft_step_s": 0.0003,
        "batch_token_s": 0.0002, "draft_batch_token_s": 0.00005, "accept_probs": [0.8, 0.7, 0.6],
        "min_new_fraction": 1.0, "decode_log_interval": 4}  # fmt: skip
CHAIN3 = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/drafts/d1",
          "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]  # fmt: skip
TREE4 = [*CHAIN3[:5], "3", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"]
SWITCH_OFF_AT_9 = {"1": {"candidate_steps": [3]}, "9": {"candidate_steps": [0]}}


@dataclass
class _Command:
    """A launcher whose command is given as is (bypassing the gate's builder, which refuses what
    these tests need SGLang to see)."""

    argv: list[str]
    version: str = "0.5.14"

    def command(self, _spec: LaunchSpec) -> list[str]:
        return self.argv

    def env(self) -> dict[str, str]:
        return {}


def _argv(version: str, sim: dict[str, Any], port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "tasks.standins.spec_launch", "--sim-config-json",
            json.dumps({"sglang_version": version, **sim}), "--model-path", "/m", "--host", "127.0.0.1",
            "--port", str(port), "--cuda-graph-max-bs" if version == "0.5.4" else "--cuda-graph-max-bs-decode", "32",
            *args]  # fmt: skip


@contextlib.contextmanager
def serving(tmp_path: Path, *launches: tuple[dict[str, Any], list[str]], version: str = "0.5.14") -> Iterator[list[LaunchedServer]]:
    """Start every (sim config, SGLang args) launch at once; yield them when all are healthy."""
    servers = []
    try:
        for sim, args in launches:
            port = free_port()
            command = _Command(_argv(version, sim, port, *args), version)
            servers.append(launch(command, LaunchSpec("/m", port), tmp_path / f"server-{port}.log"))
        with httpx.Client(trust_env=False) as client:
            for server in servers:
                wait_healthy(server, client, timeout_s=30, poll_s=0.05)
        yield servers
    finally:
        for server in servers:
            server.stop()




def _config(tmp_path: Path, raw: Any, name: str = "adaptive.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return str(path)


@dataclass
class Load:
    tok_s: float
    metas: list[dict[str, Any]]


async def _closed_loop(url: str, clients: int, requests: int, offset: int) -> Load:
    """`clients` clients each sending its next request when its last one is answered."""
    prompts = iter(range(offset, offset + requests))
    metas: list[dict[str, Any]] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        for i in prompts:
            body = {"input_ids": [5, 6, 7, i % 30000 + 8], "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}
            r = await client.post(url + "/generate", json=body, timeout=60)
            r.raise_for_status()
            metas.append(r.json()["meta_info"])

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(trust_env=False, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        elapsed = time.perf_counter() - t0
    return Load(sum(m["completion_tokens"] for m in metas) / elapsed, metas)


def measure(server: LaunchedServer, clients: int, requests: int | None = None) -> Load:
    """Closed-loop throughput at `clients` concurrent clients: the same prompts on every server."""
    return asyncio.run(_closed_loop(server.url, clients, requests or 3 * clients, offset=1000 * clients))


def info(server: LaunchedServer) -> dict[str, Any]:
    with httpx.Client(trust_env=False) as client:
        return fetch_server_info(client, server.url, "0.5.14")


def stats(server: LaunchedServer) -> dict[str, Any]:
    return httpx.get(server.url + "/_stats", timeout=10).json()["backend"]


# --- the batch cost model and the running-request cap -------------------------------------------


def test_a_draft_that_wins_at_concurrency_1_loses_at_16_and_a_tier_of_0_steps_costs_more_than_plain(tmp_path: Path) -> None:
    config = _config(tmp_path, SWITCH_OFF_AT_9)
    adaptive = [*CHAIN3, "--speculative-adaptive", "--speculative-adaptive-config", config]
    with serving(tmp_path, (LOAD, []), (LOAD, CHAIN3), (LOAD, adaptive)) as (plain, chain, adapt):
        servers = (("plain", plain), ("chain", chain), ("adaptive", adapt))
        at16 = {name: measure(s, 16, 48) for name, s in servers}
        at1 = {name: measure(s, 1, 8) for name, s in servers}  # after 16: the adaptive server switches back
        adaptive_stats = stats(adapt)
    # The batch grows the plain step by 0.2 ms a request, far less than it adds tokens.
    assert at16["plain"].tok_s > 4 * at1["plain"].tok_s
    # The 3-step chain: ~x1.36 alone, ~x0.75 among 16 (the verify's 4 tokens a request cost compute).
    assert at1["chain"].tok_s / at1["plain"].tok_s > 1.15
    assert at16["chain"].tok_s / at16["plain"].tok_s < 0.9
    # Adaptive: the chain at one request (its verifies accept > 1 token) ...
    assert at1["adaptive"].tok_s / at1["plain"].tok_s > 1.15
    assert all(m["spec_verify_ct"] > 0 and m["spec_accept_length"] > 2.0 for m in at1["adaptive"].metas)
    # ... and at 16 the tier of 9+ turns drafting off, one token a verify; the speculative pipeline
    # still runs (a verify of one token, the draft's extend), slower than a plain server's decode,
    # as on SGLang 0.5.14 (0.66x a plain server at concurrency 8 on the H200, BENCHMARKS P32).
    # (The lower bound only says it still serves: the ratio is wall time on a shared box, where the
    # speculative path's extra host work loses more to a busy CPU; 0.44 was seen under load.)
    assert 0.3 < at16["adaptive"].tok_s / at16["plain"].tok_s < 0.95
    assert sum(m["spec_accept_length"] for m in at16["adaptive"].metas) / 48 < 1.3
    log = adapt.log_text()
    assert "Switch adaptive runtime state: steps 3 -> 0, draft_tokens 4 -> 1" in log
    assert "Switch adaptive runtime state: steps 0 -> 3, draft_tokens 1 -> 4" in log
    assert "#running-req: 16," in log and "accept len: 1.00," in log  # Decode batch lines at steps 0
    assert adaptive_stats["adaptive_switches"] >= 2 and adaptive_stats["adaptive_slots"] == {"1": 3, "9": 0}


def test_a_speculative_server_caps_running_requests_at_48_unless_told(tmp_path: Path) -> None:
    fast = {**LOAD, "baseline_step_s": 0.001, "batch_token_s": 0.0}
    capped = [*CHAIN3, "--max-running-requests", "6"]
    with serving(tmp_path, (fast, []), (fast, CHAIN3), (fast, capped)) as (plain, spec, told):
        infos = [info(s)["max_running_requests"] for s in (plain, spec, told)]
        measure(told, 12, 12)
        told_stats = stats(told)
    assert infos == [4096, 48, 6]  # a plain server keeps its KV-derived cap: a 64-level load never queues
    reset = "Max running requests is reset to 48 for speculative decoding. You can override this by explicitly setting --max-running-requests."
    assert reset in spec.log_text() and reset not in plain.log_text() and reset not in told.log_text()
    assert "max_running_requests=48," in spec.log_text()
    assert told_stats["max_running"] == 6  # 12 clients, 6 running at most: the rest queued


# --- adaptive speculation: start-up as SGLang's server args and worker have it -----------------


def test_adaptive_configs_sglang_refuses_fail_start_up_with_its_message(tmp_path: Path) -> None:
    def adaptive(raw: Any) -> list[str]:
        path = _config(tmp_path, raw, f"config-{len(list(tmp_path.iterdir()))}.json")
        return [*CHAIN3, "--speculative-adaptive", "--speculative-adaptive-config", path]

    cases = {
        "BS 1: candidate_steps must be a list of non-negative ints, got [-1]": adaptive({"1": {"candidate_steps": [-1]}}),
        'speculative_adaptive_config must contain at least one integer-string BS key, e.g. {"1": {"candidate_steps": [1,3,7]}}. Got keys: '
        "['bs8', 'ema_alpha']": adaptive({"bs8": {"candidate_steps": [3]}, "ema_alpha": 0.3}),
        "--speculative-num-steps=3 is not in the adaptive config candidate_steps [1, 7]. Pass one of those values.":
            adaptive({"1": {"candidate_steps": [1]}, "8": {"candidate_steps": [7]}}),
    }  # fmt: skip
    procs = {msg: subprocess.Popen(_argv("0.5.14", {}, free_port(), *args), cwd=ROOT, stderr=subprocess.PIPE, text=True)
             for msg, args in cases.items()}  # fmt: skip
    for message, proc in procs.items():
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 1, err
        assert f"ValueError: {message}" in err and "Uvicorn running" not in err
    old = subprocess.run(_argv("0.5.4", {}, free_port(), *CHAIN3, "--speculative-adaptive"), cwd=ROOT,
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    assert old.returncode == 2 and "unrecognized arguments: --speculative-adaptive" in old.stderr


def test_adaptive_start_up_where_sglang_starts(tmp_path: Path) -> None:
    """A tree falls back to static; a key SGLang skips is skipped; no file: SGLang's default tiers."""
    tiers_and_junk = _config(tmp_path, {**SWITCH_OFF_AT_9, "bs8": {"candidate_steps": [7]}, "note": "x"})
    flag = ["--speculative-adaptive", "--speculative-adaptive-config", tiers_and_junk]
    with serving(tmp_path, (LOAD, [*TREE4, *flag]), (LOAD, [*CHAIN3, *flag]), (LOAD, [*CHAIN3, "--speculative-adaptive"])) as (
        tree, junk, default,
    ):  # fmt: skip
        tree_info, junk_info, default_info = info(tree), info(junk), info(default)
        tree_answer = measure(tree, 1, 1).metas[0]
    assert "speculative_adaptive disabled: speculative_eagle_topk=4 (only topk=1 is supported). " \
           "Falling back to static speculative params." in tree.log_text()  # fmt: skip
    assert tree_info["speculative_adaptive"] is False and tree_info["speculative_eagle_topk"] == 4
    assert tree_answer["spec_verify_ct"] > 0 and "Switch adaptive" not in tree.log_text()
    assert (junk_info["speculative_adaptive"], junk_info["speculative_adaptive_config"]) == (True, tiers_and_junk)
    assert "AdaptiveSpeculativeParams initialized: steps=3, candidate_steps=[3]" in junk.log_text()
    assert "Built adaptive runtime state steps=0: elapsed=" in junk.log_text()
    assert "steps=7" not in junk.log_text()  # "bs8" is no tier
    log = default.log_text()
    assert default_info["speculative_adaptive"] is True and default_info["speculative_adaptive_config"] is None
    assert "AdaptiveSpeculativeParams initialized: steps=3, candidate_steps=[1, 3, 7]" in log
    assert [s for s in (0, 1, 3, 7) if f"Built adaptive runtime state steps={s}:" in log] == [0, 1, 7]


# --- the slot's EMA rule and the switch cost ----------------------------------------------------


def _plan(raw: dict[str, Any], num_steps: int, tmp_path: Path) -> AdaptivePlan:
    return plan_adaptive(_config(tmp_path, raw, "plan.json"), num_steps, graph_max_bs=None)


def test_a_slot_moves_by_its_ema_after_warmup_every_interval(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runtime = AdaptiveRuntime(_plan({"1": {"candidate_steps": [1, 3, 7]}}, 3, tmp_path), switch_s=0.004)
    assert runtime.activate(1) == 3 and runtime.take_switch_s() == 0.0
    for _ in range(14):  # nothing accepted: the EMA falls from 2, but warmup holds the slot
        runtime.on_verify([0], 1)
    assert runtime.steps == 3
    runtime.on_verify([0], 1)  # batch 15: warmup 10 + interval 5
    err = capsys.readouterr().err
    assert runtime.steps == 1 and "Adaptive spec params updated: steps 3 -> 1 (ema_accept_len=0.07)" in err
    assert "Switch adaptive runtime state: steps 3 -> 1, draft_tokens 4 -> 2" in err
    assert runtime.take_switch_s() == 0.004 and runtime.take_switch_s() == 0.0  # charged to one step
    slot = StepSlot.start(3, (0, 1), {"warmup_batches": 0, "update_interval": 1})
    assert (slot.current, slot.ema) == (1, 0.0)  # 3 is no candidate: the middle one, EMA at steps - 1
    assert slot.update([0]) == 1 and slot.current == 0  # nothing accepted: speculation off
    assert slot.update([5]) == 0 and slot.current == 1  # at 0, the next interval probes upward


def test_a_switch_costs_its_step_and_steps_0_is_a_verify_of_one_token(tmp_path: Path) -> None:
    from tasks.standins.sim import SimulatedBackend, StepTimes
    from tasks.standins.sim_spec import Speculation

    plan = _plan(SWITCH_OFF_AT_9, 3, tmp_path)
    spec = Speculation("0.5.14", 3, 1, 4, [0.8], draft_step_s=0.0003, verify_step_s=0.0025)
    backend = SimulatedBackend(times=StepTimes(0.001, 0.002, batch_token_s=0.0002), speculation=spec,
                               adaptive=AdaptiveRuntime(plan, switch_s=0.05))  # fmt: skip
    backend._running = [SimpleNamespace(factor=1.0)] * 16  # type: ignore[list-item]  # a batch of 16, for its cost
    _, switched, steps = backend._step_seconds([])
    _, after, _ = backend._step_seconds([])
    # Steps 0: one draft forward (the extend) and a verify of one token a request, not a plain decode.
    assert steps == 0 and after == pytest.approx(0.0003 + 0.0025 + 0.0002 * 16) and switched == pytest.approx(after + 0.05)
    assert after > 0.002 + 0.0002 * 16
