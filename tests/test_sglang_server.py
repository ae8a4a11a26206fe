"""The SGLang-compatible server over real HTTP (stdlib client, so the server is tested on its own)."""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tasks.standins.server import ServerProcess, ServerThread, serve_main, start_server_thread
from tasks.standins.sim import SIM_EOS_ID, plan_completion, simulated_output

SMALL = {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}}
# The meta_info keys a real SGLang 0.5.14 baseline returned (tests/fixtures/sglang-0.5.14/).
META_KEYS = set(json.loads((Path(__file__).parent / "fixtures/sglang-0.5.14/gen-base.json").read_text())["meta_info"])


def call(url: str, body: Any = None, timeout: float = 10.0) -> tuple[int, Any]:
    """GET (body None) or POST JSON; returns (status, parsed JSON or text)."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


@pytest.fixture
def server() -> Iterator[ServerThread]:
    with start_server_thread(step_latency_s=0.002, max_batch=8, context_length=64) as s:
        yield s


def rid_with(finish: str, max_new: int) -> str:
    """A rid whose simulated completion ends with `finish` ("stop" or "length")."""
    return next(f"r{i}" for i in range(1000) if plan_completion(f"r{i}", max_new).finish == finish)


def test_generate_response_shape_and_determinism(server: ServerThread) -> None:
    stop_rid, length_rid = rid_with("stop", 8), rid_with("length", 8)
    status, out = call(server.url + "/generate", {"input_ids": [5, 6, 7], "rid": stop_rid,
                                                  "sampling_params": {"max_new_tokens": 8}})
    assert status == 200
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert set(out["meta_info"]) == META_KEYS
    meta = out["meta_info"]
    plan = plan_completion(stop_rid, 8)
    assert meta["id"] == stop_rid
    assert meta["finish_reason"] == {"type": "stop", "matched": SIM_EOS_ID}
    assert meta["prompt_tokens"] == 3
    assert meta["completion_tokens"] == plan.n_tokens == len(out["output_ids"])
    assert out["output_ids"] == simulated_output(stop_rid, plan, 32000).output_ids
    assert out["output_ids"][-1] == SIM_EOS_ID

    _, again = call(server.url + "/generate", {"input_ids": [9], "rid": stop_rid,
                                               "sampling_params": {"max_new_tokens": 8}})
    assert again["output_ids"] == out["output_ids"]

    _, cut = call(server.url + "/generate", {"input_ids": [1], "rid": length_rid,
                                             "sampling_params": {"max_new_tokens": 8}})
    assert cut["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert len(cut["output_ids"]) == 8


def test_batched_generate_and_text_input(server: ServerThread) -> None:
    body = {
        "input_ids": [[1, 2], [3], [4, 5, 6]],
        "rid": ["a", "b", "c"],
        "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3, "ignore_eos": True},
                            {"max_new_tokens": 1}],
    }
    status, out = call(server.url + "/generate", body)
    assert status == 200 and isinstance(out, list)
    assert [o["meta_info"]["id"] for o in out] == ["a", "b", "c"]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [2, 1, 3]
    assert out[1]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}

    status, out = call(server.url + "/generate", {"text": "hi!", "rid": "t",
                                                  "sampling_params": {"max_new_tokens": 1}})
    assert status == 200 and out["meta_info"]["prompt_tokens"] == 3

    status, out = call(server.url + "/generate", {"input_ids": [[1], [2]], "rid": ["only-one"]})
    assert status == 400 and "rid must be a list of 2 strings" in out["error"]["message"]


def test_context_overflow_is_400_naming_both_lengths(server: ServerThread) -> None:
    status, out = call(server.url + "/generate", {"input_ids": list(range(70))})
    assert status == 400
    assert out["error"]["message"] == (
        "The input (70 tokens) is longer than the model's context length (64 tokens)."
    )
    status, out = call(server.url + "/generate", {"input_ids": list(range(10)),
                                                  "sampling_params": {"max_new_tokens": 60}})
    assert status == 400
    msg = out["error"]["message"]
    assert "maximum context length of 64 tokens" in msg and "total of 70 tokens" in msg


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"rid": "x"}, "Either text or input_ids"),
        ({"input_ids": [1, -2]}, "input_ids must be"),
        ({"input_ids": []}, "input_ids must be"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": "8"}}, "sampling_params.max_new_tokens"),
        ({"input_ids": [1], "sampling_params": {"foo": 1}}, "unknown field(s) ['foo']"),
        ({"input_ids": [1], "rid": 5}, "rid must be a string"),
        (b"{not json", "not valid JSON"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_bad_requests_are_400_naming_the_field(server: ServerThread, body: Any, needle: str) -> None:
    status, out = call(server.url + "/generate", body)
    assert status == 400
    assert needle in out["error"]["message"]


def test_info_health_and_cache_endpoints(server: ServerThread) -> None:
    assert call(server.url + "/health") == (200, "")
    assert call(server.url + "/health_generate") == (200, "")
    status, info = call(server.url + "/server_info")
    assert status == 200
    assert call(server.url + "/get_server_info") == (200, info)
    assert {"model_path", "context_length", "max_running_requests", "version"} <= set(info)
    assert info["context_length"] == 64 and info["max_running_requests"] == 8
    assert info["version"].startswith("eaglescale-compat/0.5.")
    assert call(server.url + "/flush_cache", {}) == (200, "Cache flushed.")
    _, stats = call(server.url + "/_stats")
    # Both spellings of server_info count under one name.
    assert stats["requests"] == {"health": 1, "health_generate": 1, "server_info": 2, "flush_cache": 1}
    assert stats["flushes"] == 1
    assert stats["backend"]["kind"] == "simulated"


def test_simulator_runs_at_most_max_batch_and_steps_exactly() -> None:
    with start_server_thread(step_latency_s=0.002, max_batch=2) as s:
        body = {"input_ids": [[1]] * 6, "rid": [f"q{i}" for i in range(6)],
                "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
        status, out = call(s.url + "/generate", body)
        assert status == 200 and [o["meta_info"]["completion_tokens"] for o in out] == [4] * 6
        _, stats = call(s.url + "/_stats")
    b = stats["backend"]
    # Three waves of two requests, four one-token steps each.
    assert (b["max_running"], b["max_waiting"], b["steps"], b["tokens"]) == (2, 6, 12, 24)


def test_zero_latency_mode_takes_no_steps() -> None:
    with start_server_thread(step_latency_s=0.0) as s:
        status, out = call(s.url + "/generate", {"input_ids": [1], "rid": "z",
                                                 "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}})
        _, stats = call(s.url + "/_stats")
    assert status == 200 and out["meta_info"]["completion_tokens"] == 5
    assert stats["backend"]["steps"] == 0 and stats["backend"]["tokens"] == 5


def test_fault_5xx_count_and_scope(server: ServerThread) -> None:
    status, out = call(server.url + "/_fault", {"mode": "5xx", "count": 2, "status": 500})
    assert status == 200 and out["fault"]["mode"] == "5xx"
    statuses = [call(server.url + "/generate", SMALL)[0] for _ in range(4)]
    assert statuses == [500, 500, 200, 200]
    assert call(server.url + "/health_generate")[0] == 200  # scope "generate" spares health

    call(server.url + "/_fault", {"mode": "5xx", "scope": "all"})
    assert call(server.url + "/health_generate")[0] == 503
    assert call(server.url + "/server_info")[0] == 503
    status, body = call(server.url + "/generate", SMALL)
    assert status == 503 and "injected fault" in body["error"]["message"]
    _, stats = call(server.url + "/_stats")
    assert stats["faults"]["injected"] == 5 and stats["faults"]["by_mode"] == {"5xx": 5}


def test_fault_rate_is_seeded(server: ServerThread) -> None:
    def sequence() -> list[int]:
        call(server.url + "/_fault", {"mode": "5xx", "rate": 0.5, "seed": 7})
        return [call(server.url + "/generate", SMALL)[0] for _ in range(16)]

    first = sequence()
    assert first == sequence()
    assert 0 < first.count(503) < 16


def test_fault_abort_answers_200_with_abort_reason(server: ServerThread) -> None:
    call(server.url + "/_fault", {"mode": "abort", "count": 1, "status": 400})
    status, out = call(server.url + "/generate", {**SMALL, "rid": "ab"})
    assert status == 200
    assert out["meta_info"]["finish_reason"] == {
        "type": "abort", "message": "injected fault: aborted", "status_code": 400
    }
    assert out["output_ids"] == []
    assert call(server.url + "/generate", SMALL)[0] == 200


def test_fault_reset_drops_the_connection(server: ServerThread) -> None:
    call(server.url + "/_fault", {"mode": "reset", "count": 1})
    with pytest.raises((ConnectionResetError, http.client.RemoteDisconnected, urllib.error.URLError)):
        call(server.url + "/generate", SMALL)
    assert call(server.url + "/generate", SMALL)[0] == 200


@pytest.mark.parametrize("mode", ["hang", "timeout"])
def test_fault_hang_and_timeout_outlast_the_client(server: ServerThread, mode: str) -> None:
    call(server.url + "/_fault", {"mode": mode, "count": 1, "delay_s": 30})
    with pytest.raises((TimeoutError, socket.timeout, urllib.error.URLError)):
        call(server.url + "/generate", SMALL, timeout=0.3)
    # The server notices the client left and frees the request well before its own bound.
    deadline = time.monotonic() + 10
    while call(server.url + "/_stats")[1]["in_flight"] != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert call(server.url + "/_stats")[1]["in_flight"] == 0


def test_fault_slow_still_answers(server: ServerThread) -> None:
    call(server.url + "/_fault", {"mode": "slow", "count": 1, "delay_s": 0.05})
    status, out = call(server.url + "/generate", {"input_ids": [1], "rid": "s",
                                                  "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and out["meta_info"]["e2e_latency"] >= 0.05


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"mode": "explode"}, "mode 'explode'"),
        ({"mode": "5xx", "rate": 2}, "rate"),
        ({"mode": "5xx", "status": 404}, "status for mode 5xx"),
        ({"mode": "5xx", "count": -1}, "count"),
        ({"mode": "slow", "delay_s": "1"}, "delay_s"),
        ({"mode": "5xx", "scope": "health"}, "scope 'health'"),
        ({"mode": "5xx", "bogus": 1}, "unknown field(s) ['bogus']"),
    ],
)
def test_bad_fault_spec_is_400_naming_the_field(server: ServerThread, spec: dict, needle: str) -> None:
    status, out = call(server.url + "/_fault", spec)
    assert status == 400 and needle in out["error"]["message"]
    assert call(server.url + "/_fault")[1]["fault"]["mode"] == "none"


def test_cli_errors_name_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert serve_main(["--simulate", "--fault", "5xx", "--fault-rate", "2"]) == 2
    assert "--fault-rate must be a number in [0, 1]" in capsys.readouterr().err
    assert serve_main(["--port", "1"]) == 2
    assert "one of the arguments --model --simulate --router is required" in capsys.readouterr().err
    assert serve_main(["--simulate", "--max-batch", "0"]) == 2
    assert "--max-batch must be >= 1" in capsys.readouterr().err


def test_subprocess_server_with_fault_from_the_command_line() -> None:
    proc = ServerProcess(["--simulate", "--step-latency-ms", "1", "--fault", "5xx",
                          "--fault-status", "502", "--fault-count", "1"])
    try:
        assert proc.url.startswith("http://127.0.0.1:")
        assert call(proc.url + "/generate", SMALL)[0] == 502
        assert call(proc.url + "/generate", SMALL)[0] == 200
    finally:
        proc.stop()
    assert proc.proc.returncode == 0  # SIGTERM is a clean shutdown
    assert "backend=simulated" in proc.stderr()


def test_subprocess_that_cannot_start_reports_why() -> None:
    with pytest.raises(RuntimeError, match=r"(?s)did not start \(exit code 2\).*--port must be 0..65535"):
        ServerProcess(["--simulate", "--port", "70000"])


def test_model_backend_serves_the_tiny_target(tiny_target_dir: Any) -> None:
    from tasks.engines.local import LocalEngine

    local = LocalEngine(str(tiny_target_dir))
    with start_server_thread(model_path=str(tiny_target_dir), max_batch=4) as s:
        _, info = call(s.url + "/server_info")
        assert info["context_length"] == local.context_length
        assert info["model_path"] == str(tiny_target_dir)
        ids = [local.tokenizer.encode(t, add_special_tokens=False) for t in ("hello", "a b c")]
        status, out = call(s.url + "/generate", {"input_ids": ids, "rid": ["m1", "m2"],
                                                 "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
        assert status == 200 and len(out) == 2
        status, err = call(s.url + "/generate", {"input_ids": [1], "sampling_params": {"ignore_eos": True}})
        assert status == 400 and "ignore_eos" in err["error"]["message"]
        assert call(s.url + "/health_generate")[0] == 200
    for o, prompt in zip(out, ids, strict=True):
        assert o["meta_info"]["prompt_tokens"] == len(prompt)
        assert o["meta_info"]["finish_reason"]["type"] in ("stop", "length")
        assert o["output_ids"] and o["meta_info"]["completion_tokens"] == len(o["output_ids"])
    local.close()
