"""The `sglang` engine against real SGLang-compatible servers on 127.0.0.1 (threads and processes)."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tasks.config import EngineConfig
from tasks.engines.base import (
    DeadLetter,
    EngineUnavailable,
    GenerationRequest,
    GenerationResult,
    Outcome,
    SamplingParams,
)
from tasks.engines.sglang_client import SGLangEngine
from tasks.engines.sglang_wire import MalformedResponse, error_message, read_generate_reply
from tasks.standins.server import ServerProcess, ServerThread, start_server_thread
from tasks.standins.sim import plan_completion, simulated_output

pytestmark = pytest.mark.timeout(60)


def make_requests(n: int, max_new: int = 8, prompt_len: int = 4, tag: str = "") -> list[GenerationRequest]:
    return [
        GenerationRequest(
            hashlib.sha256(f"{tag}{i}".encode()).hexdigest(), f"p{i}", 0,
            tuple(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=max_new),
        )
        for i in range(n)
    ]


def engine_config(*urls: str, **overrides: Any) -> EngineConfig:
    fast = {
        "kind": "sglang", "endpoints": list(urls), "concurrency_per_server": 8,
        "request_timeout_s": 5.0, "connect_timeout_s": 1.0, "max_attempts": 4,
        "backoff_base_s": 0.005, "backoff_max_s": 0.02, "unhealthy_after": 100,
        "health_recheck_s": 0.2,
    }
    return EngineConfig(**(fast | overrides))


def run(engine: SGLangEngine, requests: list[GenerationRequest]) -> dict[str, Outcome]:
    """generate(), checking that the sink saw each request exactly once."""
    seen: list[Outcome] = []
    engine.generate(requests, seen.append)
    ids = [o.request_id for o in seen]
    assert len(ids) == len(set(ids)), "a request got two outcomes"
    assert set(ids) == {r.request_id for r in requests}
    return {o.request_id: o for o in seen}


def stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/_stats", timeout=10) as resp:
        return json.loads(resp.read())


def set_fault(url: str, **spec: Any) -> None:
    req = urllib.request.Request(url + "/_fault", data=json.dumps(spec).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def sim() -> Iterator[ServerThread]:
    with start_server_thread(step_latency_s=0.002, max_batch=64) as s:
        yield s


def test_every_request_gets_its_simulated_result(sim: ServerThread) -> None:
    requests = make_requests(40)
    with SGLangEngine(engine_config(sim.url)) as engine:
        outcomes = run(engine, requests)
        (health,) = engine.health()
    for r in requests:
        o = outcomes[r.request_id]
        plan = plan_completion(r.request_id, 8)
        assert isinstance(o, GenerationResult)
        assert o.output_ids == simulated_output(r.request_id, plan, 32000).output_ids
        assert (o.finish_reason, o.completion_tokens, o.prompt_tokens) == (plan.finish, plan.n_tokens, 4)
        assert o.server == sim.url and o.latency_s > 0
    assert {o.finish_reason for o in outcomes.values()} == {"stop", "length"}
    assert (health.url, health.healthy, health.completed, health.in_flight, health.failures) == (
        sim.url, True, 40, 0, 0
    )
    s = stats(sim.url)
    assert s["generate_requests"] == 40
    assert s["requests"]["health_generate"] == 1  # checked once, before first use


@pytest.mark.parametrize(
    ("fault", "timeout_s"),
    [
        ({"mode": "5xx", "count": 3}, 5.0),
        ({"mode": "5xx", "count": 2, "status": 500}, 5.0),
        ({"mode": "reset", "count": 3}, 5.0),
        # A faulted request answers after 5 s or never; 2 s is far above a normal answer's
        # time even on a loaded 2-core machine, so only the faulted ones time out.
        ({"mode": "timeout", "count": 2, "delay_s": 5.0}, 2.0),
        ({"mode": "hang", "count": 2}, 2.0),
        ({"mode": "abort", "count": 3}, 5.0),
    ],
    ids=["5xx", "500", "reset", "timeout", "hang", "abort"],
)
def test_transport_faults_are_retried(sim: ServerThread, fault: dict, timeout_s: float) -> None:
    set_fault(sim.url, **fault)
    requests = make_requests(30, tag=fault["mode"])
    with SGLangEngine(engine_config(sim.url, request_timeout_s=timeout_s)) as engine:
        outcomes = run(engine, requests)
        (health,) = engine.health()
    assert all(isinstance(o, GenerationResult) for o in outcomes.values())
    s = stats(sim.url)
    assert s["faults"]["injected"] == fault["count"]
    assert health.completed == len(requests)
    if timeout_s < 5.0:
        # A timeout is the client's clock: a stall of the loaded machine could add one, so
        # each faulted request is retried at least once, whatever else happened.
        assert s["generate_requests"] >= len(requests) + fault["count"]
        assert health.failures >= fault["count"]
    else:  # an answered fault: exactly one retry each
        assert s["generate_requests"] == len(requests) + fault["count"]
        assert health.failures == fault["count"]


def test_slow_answers_are_not_retried(sim: ServerThread) -> None:
    set_fault(sim.url, mode="slow", count=3, delay_s=0.1)
    with SGLangEngine(engine_config(sim.url)) as engine:
        outcomes = run(engine, make_requests(12))
    assert all(isinstance(o, GenerationResult) for o in outcomes.values())
    assert stats(sim.url)["generate_requests"] == 12


def test_abort_with_4xx_status_is_a_dead_letter(sim: ServerThread) -> None:
    set_fault(sim.url, mode="abort", count=2, status=400)
    with SGLangEngine(engine_config(sim.url, concurrency_per_server=1)) as engine:
        outcomes = list(run(engine, make_requests(5)).values())
    dead = [o for o in outcomes if isinstance(o, DeadLetter)]
    assert [(d.error_class, d.message, d.attempts) for d in dead] == [
        ("abort_400", "injected fault: aborted", 1)
    ] * 2
    assert stats(sim.url)["generate_requests"] == 5


def test_4xx_and_context_overflow_are_dead_letters_without_retry() -> None:
    with start_server_thread(step_latency_s=0.002, context_length=64) as s:
        ok = make_requests(3, max_new=4)
        too_long = GenerationRequest("a" * 64, "long", 0, tuple(range(70)), SamplingParams(max_new_tokens=4))
        too_much = GenerationRequest("b" * 64, "much", 0, (1, 2), SamplingParams(max_new_tokens=62))
        bad = GenerationRequest("c" * 64, "bad", 0, (1, 2), SamplingParams(temperature=-1.0, max_new_tokens=4))
        with SGLangEngine(engine_config(s.url)) as engine:
            outcomes = run(engine, [*ok, too_long, too_much, bad])
            (health,) = engine.health()
        assert stats(s.url)["generate_requests"] == 6
    assert all(isinstance(outcomes[r.request_id], GenerationResult) for r in ok)
    long_dead, much_dead, bad_dead = (outcomes[k * 64] for k in "abc")
    assert isinstance(long_dead, DeadLetter) and long_dead.error_class == "context_overflow"
    assert "(70 tokens)" in long_dead.message and "(64 tokens)" in long_dead.message
    assert isinstance(much_dead, DeadLetter) and much_dead.error_class == "context_overflow"
    assert isinstance(bad_dead, DeadLetter) and bad_dead.error_class == "http_400"
    assert "sampling_params.temperature" in bad_dead.message
    assert (health.healthy, health.failures) == (True, 0)


def test_exhausted_requests_are_requeued_once_then_dead(sim: ServerThread) -> None:
    set_fault(sim.url, mode="5xx")  # every /generate fails; health stays fine
    with SGLangEngine(engine_config(sim.url, max_attempts=2)) as engine:
        outcomes = run(engine, make_requests(3))
    for o in outcomes.values():
        assert isinstance(o, DeadLetter)
        assert (o.error_class, o.attempts) == ("transport_exhausted", 4)
        assert "HTTP 503" in o.message and sim.url in o.message
    assert stats(sim.url)["generate_requests"] == 12


def test_requeue_runs_after_the_rest_of_the_call(sim: ServerThread) -> None:
    set_fault(sim.url, mode="5xx", count=2)  # the first request's two attempts fail
    requests = make_requests(3)
    order: list[str] = []
    with SGLangEngine(engine_config(sim.url, max_attempts=2, concurrency_per_server=1)) as engine:
        engine.generate(requests, lambda o: order.append(o.request_id))
    assert order == [requests[1].request_id, requests[2].request_id, requests[0].request_id]
    assert stats(sim.url)["generate_requests"] == 5


def test_failover_when_a_server_dies() -> None:
    args = ["--simulate", "--step-latency-ms", "5"]
    with ServerProcess(args) as a, ServerProcess(args) as b:
        cfg = engine_config(a.url, b.url, unhealthy_after=2, health_recheck_s=30.0, max_attempts=6)
        requests = make_requests(80, max_new=6)
        seen: list[Outcome] = []

        def sink(o: Outcome) -> None:
            seen.append(o)
            if len(seen) == 15:
                b.kill()  # a crash mid-run: in-flight requests get connection resets

        with SGLangEngine(cfg) as engine:
            engine.generate(requests, sink)
            health = {h.url: h for h in engine.health()}
    assert sorted(o.request_id for o in seen) == sorted(r.request_id for r in requests)
    assert all(isinstance(o, GenerationResult) for o in seen)
    on_b = sum(o.server == b.url for o in seen)
    assert 0 < on_b < 80 and on_b + sum(o.server == a.url for o in seen) == 80
    assert health[b.url].healthy is False and health[b.url].extra["state"] == "down"
    assert health[b.url].failures >= 2 and health[a.url].healthy is True
    assert (health[a.url].completed, health[b.url].completed) == (80 - on_b, on_b)


def test_a_server_failing_health_is_never_used() -> None:
    with start_server_thread(step_latency_s=0.002) as a, start_server_thread(step_latency_s=0.002) as b:
        set_fault(b.url, mode="5xx", scope="all")
        with SGLangEngine(engine_config(a.url, b.url, health_recheck_s=30.0)) as engine:
            outcomes = run(engine, make_requests(20))
            health = {h.url: h for h in engine.health()}
        assert {o.server for o in outcomes.values()} == {a.url}
        assert stats(b.url)["generate_requests"] == 0
    assert health[b.url].healthy is False
    assert health[b.url].last_error.startswith("health_generate: HTTP 503")


def test_requests_in_flight_on_a_server_leaving_rotation_finish_there() -> None:
    """b fails its first two new requests and leaves rotation while it still generates the
    others: those finish on b and are delivered once; only the two failures are sent again."""
    with start_server_thread(step_latency_s=0.02) as a, start_server_thread(step_latency_s=0.02) as b:
        set_fault(b.url, mode="5xx", count=2)
        cfg = engine_config(a.url, b.url, unhealthy_after=2, health_recheck_s=30.0)
        requests = make_requests(40, max_new=16)
        downed_with_in_flight: list[int] = []
        seen: list[Outcome] = []

        def sink(o: Outcome) -> None:
            seen.append(o)
            b_health = next(h for h in engine.health() if h.url == b.url)
            if b_health.failures >= 2 and not downed_with_in_flight:
                downed_with_in_flight.append(b_health.in_flight)

        with SGLangEngine(cfg) as engine:
            engine.generate(requests, sink)
            health = {h.url: h for h in engine.health()}
        sent = stats(a.url)["generate_requests"] + stats(b.url)["generate_requests"]
    assert sorted(o.request_id for o in seen) == sorted(r.request_id for r in requests)
    assert all(isinstance(o, GenerationResult) for o in seen)
    assert health[b.url].failures == 2
    assert downed_with_in_flight and downed_with_in_flight[0] > 0  # b held work when it failed
    # Every request once, plus one re-send per injected failure: nothing answered is re-sent.
    assert sent == 40 + 2
    attempts = {o.request_id: o.attempts for o in seen if isinstance(o, GenerationResult)}
    assert sum(attempts.values()) == sent and sorted(attempts.values())[-2:] == [2, 2]
    on_b = [o for o in seen if o.server == b.url]
    assert on_b and health[b.url].completed == len(on_b) and health[a.url].completed == 40 - len(on_b)


def test_a_hung_server_leaves_rotation_and_its_requests_are_resent_after_their_timeout() -> None:
    with start_server_thread(step_latency_s=0.005) as a, start_server_thread(step_latency_s=0.005) as b:
        # b hangs mid-run: the watchdog's probes (1 s timeout, two failures) take it out of
        # rotation long before the request timeout (5 s); its hung requests end at their own
        # timeout and go to a. Both margins are seconds: a loaded 2-core machine keeps them.
        cfg = engine_config(a.url, b.url, request_timeout_s=5.0, unhealthy_after=2, health_recheck_s=0.2)
        requests = make_requests(60, max_new=6)
        seen: list[Outcome] = []
        hung_at: list[float] = []

        def sink(o: Outcome) -> None:
            seen.append(o)
            if len(seen) == 10:
                set_fault(b.url, mode="hang", scope="all")
                hung_at.append(time.monotonic())

        with SGLangEngine(cfg, health_timeout_s=1.0) as engine:
            engine.generate(requests, sink)
            health = {h.url: h for h in engine.health()}
        b_stats = stats(b.url)
        sent = stats(a.url)["generate_requests"] + b_stats["generate_requests"]
    assert sorted(o.request_id for o in seen) == sorted(r.request_id for r in requests)
    assert all(isinstance(o, GenerationResult) for o in seen)
    assert health[b.url].healthy is False and "timed out" in health[b.url].last_error
    assert health[b.url].extra["health_checks"] >= 2  # probed (and failed) after the hang
    assert health[a.url].completed + health[b.url].completed == 60
    resent = [o for o in seen if o.attempts > 1]
    assert resent and all(o.server == a.url for o in resent)
    assert sent == 60 + len(resent)  # each hung request sent twice, nothing else
    assert time.monotonic() - hung_at[0] >= 5.0  # they waited for their own timeout


def test_engine_unavailable_after_every_server_is_gone() -> None:
    server = start_server_thread(step_latency_s=0.01)
    cfg = engine_config(server.url, unhealthy_after=1, health_recheck_s=0.1, max_attempts=10)
    seen: list[Outcome] = []

    def sink(o: Outcome) -> None:
        seen.append(o)
        if len(seen) == 5:
            server.stop()

    with SGLangEngine(cfg, unavailable_after_s=0.3) as engine:
        with pytest.raises(EngineUnavailable, match="no SGLang server in rotation for 0.3s"):
            engine.generate(make_requests(40, max_new=6), sink)
        assert engine.health()[0].healthy is False
    ids = [o.request_id for o in seen]
    assert 5 <= len(ids) < 40 and len(ids) == len(set(ids))
    assert all(isinstance(o, GenerationResult) for o in seen)


def test_unreachable_endpoint_raises_without_outcomes_and_hides_credentials() -> None:
    url = closed_port_url().replace("http://", "http://user:s3cret@")
    seen: list[Outcome] = []
    with SGLangEngine(engine_config(url, health_recheck_s=0.05), unavailable_after_s=0.2) as engine:
        with pytest.raises(EngineUnavailable) as info:
            engine.generate(make_requests(3), seen.append)
        (health,) = engine.health()
    assert seen == []
    assert "s3cret" not in str(info.value) and "s3cret" not in health.url
    assert "health_generate" in str(info.value)


def test_concurrency_limit_is_shared_by_concurrent_calls() -> None:
    with start_server_thread(step_latency_s=0.005, max_batch=64) as s:
        results: dict[int, dict[str, Outcome]] = {}
        with SGLangEngine(engine_config(s.url, concurrency_per_server=3)) as engine:

            def call(k: int) -> None:
                results[k] = run(engine, make_requests(30, max_new=4, tag=f"t{k}-"))

            threads = [threading.Thread(target=call, args=(k,)) for k in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        assert stats(s.url)["max_in_flight"] == 3
    assert [len(results[k]) for k in range(2)] == [30, 30]


def test_sink_errors_reach_the_caller_and_the_engine_keeps_working(sim: ServerThread) -> None:
    def failing_sink(o: Outcome) -> None:
        raise KeyError("journal full")

    with SGLangEngine(engine_config(sim.url)) as engine:
        with pytest.raises(KeyError, match="journal full"):
            engine.generate(make_requests(10), failing_sink)
        assert len(run(engine, make_requests(10, tag="again"))) == 10


def test_bad_config_and_calls_are_rejected(sim: ServerThread) -> None:
    with pytest.raises(ValueError, match="engine.endpoints: the sglang engine needs at least one"):
        SGLangEngine(engine_config())
    with pytest.raises(ValueError, match="'localhost:30000' is not an http"):
        SGLangEngine(engine_config("localhost:30000"))
    with pytest.raises(ValueError, match="duplicate URLs"):
        SGLangEngine(engine_config(sim.url, sim.url + "/"))
    engine = SGLangEngine(engine_config(sim.url))
    (r,) = make_requests(1)
    with pytest.raises(ValueError, match=f"duplicate request_id '{r.request_id}'"):
        engine.generate([r, r], lambda o: None)
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate([r], lambda o: None)


def test_greedy_outputs_equal_the_local_engine(tiny_target_dir: Path) -> None:
    from tasks.engines.local import LocalEngine

    local = LocalEngine(str(tiny_target_dir))
    texts = ["hello there", "write a poem", "what is two plus two", "explain", "a b c d e f"]
    requests = [
        GenerationRequest(hashlib.sha256(t.encode()).hexdigest(), t, 0,
                          tuple(local.tokenizer.encode(t, add_special_tokens=False)),
                          SamplingParams(temperature=0.0, max_new_tokens=12))
        for t in texts
    ]
    expected = {o.request_id: o for o in local.generate_batch(requests)}
    local.close()
    with (
        start_server_thread(model_path=str(tiny_target_dir), max_batch=4) as s,
        SGLangEngine(engine_config(s.url)) as engine,
    ):
        outcomes = run(engine, requests)
    for rid, want in expected.items():
        got = outcomes[rid]
        assert isinstance(got, GenerationResult) and isinstance(want, GenerationResult)
        assert (got.output_ids, got.text, got.finish_reason) == (want.output_ids, want.text, want.finish_reason)
        assert got.completion_tokens == len(want.output_ids) and got.server == s.url


def test_reply_parsing_accepts_sglang_shapes_and_rejects_others() -> None:
    meta = {"id": "r", "prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 1, "e2e_latency": 0.5}
    body = {"text": "hi", "output_ids": [7, 2], "meta_info": {**meta, "finish_reason": {"type": "stop", "matched": 2}}}
    reply = read_generate_reply(json.dumps(body).encode())
    assert (reply.finish, reply.output_ids, reply.cached_tokens, reply.e2e_latency) == ("stop", [7, 2], 1, 0.5)
    as_list = read_generate_reply(json.dumps([{**body, "meta_info": {**meta, "finish_reason": "length"}}]).encode())
    assert as_list.finish == "length"
    aborted = {**body, "meta_info": {**meta, "finish_reason": {"type": "abort", "message": "oom", "status_code": 503}}}
    reply = read_generate_reply(json.dumps(aborted).encode())
    assert (reply.finish, reply.abort_message, reply.abort_status) == ("abort", "oom", 503)
    for bad in (b"<html>", b'{"text": "x"}', json.dumps({**body, "meta_info": {**meta, "finish_reason": None}}).encode()):
        with pytest.raises(MalformedResponse):
            read_generate_reply(bad)
    assert error_message(b'{"error": {"message": "too long"}}') == "too long"
    assert error_message(b'{"detail": "Not Found"}') == "Not Found"
    assert error_message(b"Bad Gateway") == "Bad Gateway"
