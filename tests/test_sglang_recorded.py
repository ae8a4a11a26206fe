"""What a real SGLang 0.5.14 returned and logged on the H200 node (tests/fixtures/sglang-0.5.14/)
against our side: the client and the gate parse the real bodies and log lines, and the stand-ins
(the compatible server, the speculative emulator) answer with exactly the recorded key sets and
log in the recorded wording. Real processes and real HTTP throughout."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tasks.config.gate_section import GateConfig
from tasks.engines.sglang_wire import (
    MalformedResponse,
    error_message,
    read_generate_replies,
    read_generate_reply,
)
from tasks.gate.benchmark import (
    STUCK_DIAGNOSIS,
    GateRunner,
    check_acceptance,
    record_generate_answer,
)
from tasks.gate.plan import BenchConfig, GateStopped, plan_configs
from tasks.gate.prompts import BenchPrompt
from tasks.gate.records import RequestRecord
from tasks.sglang.command import LaunchSpec, SpecParams
from tasks.sglang.server_process import (
    EmulatedLauncher,
    check_server_info,
    fetch_server_info,
    free_port,
    launch,
    parse_server_log,
    wait_healthy,
)
from tasks.sglang.server_settings import ServerSettings
from tasks.standins.server import ServerThread, start_server_thread

FIX = Path(__file__).parent / "fixtures/sglang-0.5.14"
H200 = ServerSettings(attention_backend="triton", sampling_backend="pytorch", grammar_backend="none",
                      skip_tokenizer_init=True, dtype="bfloat16")  # fmt: skip
# The over-long request whose answer was recorded: 1 input token + 99999 new > 2048.
OVERLONG = {"input_ids": [5], "sampling_params": {"max_new_tokens": 99999}}


def raw(name: str) -> bytes:
    return (FIX / name).read_bytes()


def recorded(name: str) -> Any:
    return json.loads(raw(name))


def key_sets(item: dict[str, Any]) -> tuple[set[str], set[str]]:
    return set(item), set(item["meta_info"])


# --- the client and the gate read the real answers -----------------------------------------------


def test_the_client_reads_the_recorded_answers() -> None:
    base = read_generate_reply(raw("gen-base.json"))
    assert (base.finish, base.text, len(base.output_ids), base.output_ids[-1]) == ("stop", "", 23, 1)
    assert (base.prompt_tokens, base.completion_tokens, base.cached_tokens) == (8, 23, 0)
    assert base.e2e_latency == pytest.approx(0.03720807700005935)
    spec = read_generate_reply(raw("gen-eagle3.json"))
    assert spec.output_ids == base.output_ids and spec.meta["spec_verify_ct"] == 21
    batch = read_generate_replies(raw("genbatch-eagle3.json"))
    assert [(r.finish, r.completion_tokens, r.cached_tokens, r.meta["spec_verify_ct"]) for r in batch] == [
        ("length", 8, 1, 7), ("length", 8, 0, 7)]  # fmt: skip
    assert [r.output_ids for r in batch] == [r.output_ids for r in read_generate_replies(raw("genbatch-base.json"))]
    with pytest.raises(MalformedResponse, match="malformed /generate response"):
        read_generate_reply(raw("genbatch-base.json"))  # two answers are not one
    message = error_message(raw("gen-overlong-base.json"))
    assert message.startswith("Requested token count exceeds the model's maximum context length of 2048 tokens.")
    assert "context length" in message  # what the client's dead-letter classification keys on


# Hand-made, not recorded (see the fixtures' README): the gate's re-score of reference [985, 1464, 1]
# after prompt [5, 6, 7, 8], top 3. Replace with the node's recording and its values.
LOGPROBS = "gen-logprobs-base.json"  # the gate's re-score on the H200's SmolLM2 server (run 9)


def test_the_gate_reads_a_logprob_answer() -> None:
    from tasks.engines.sglang_wire import TokenLogprob
    from tasks.gate.lossless import evidence_from_sglang, rescore_body

    request = recorded("gen-logprobs-base.request.json")
    prompt, reference = request["input_ids"][:382], request["input_ids"][382:]
    assert len(reference) == 24 and request == rescore_body(prompt, reference, 5, request["rid"])
    reply = read_generate_reply(raw(LOGPROBS))
    lp = reply.logprobs
    assert lp is not None and (reply.finish, reply.output_ids, reply.stop_token) == ("length", [30], None)
    # Entry 0 is the prompt's last token with a null logprob; entry j the reference's token j - 1.
    assert len(lp.input_token) == 25 and [e.token_id for e in lp.input_token] == [prompt[-1], *reference]
    assert lp.input_token[:3] == [TokenLogprob(None, 198), TokenLogprob(-0.7745131254196167, 2068),
                                  TokenLogprob(-1.4849522113800049, 1363)]  # fmt: skip
    assert lp.input_top[0] is None and lp.input_top[2][:3] == [
        TokenLogprob(-1.4849522113800049, 1363), TokenLogprob(-2.109952211380005, 11766),
        TokenLogprob(-2.109952211380005, 1464)]  # fmt: skip
    assert lp.output_token == [TokenLogprob(-0.4039669632911682, 30)]
    assert lp.output_top[0][1] == TokenLogprob(-2.0289669036865234, 284)
    evidence = evidence_from_sglang(lp, prompt, reference, 5)
    # Output positions 0..23 from input_top_logprobs[1..24], position 24 (after the reference) from the output's.
    assert len(evidence.positions) == 25 and evidence.positions[0].token == 2068 and evidence.positions[24].token is None
    assert evidence.positions[1].top[:2] == ((1363, -1.4849522113800049), (11766, -2.109952211380005))
    assert evidence.positions[24].top[0] == (30, -0.4039669632911682)
    # The decode that produced this reference chose the re-score's top token at every position.
    assert evidence.argmax_flips() == 0
    assert read_generate_reply(raw("gen-base.json")).logprobs is None  # asked for none, got none


def test_a_decode_with_logprobs_reads_its_own_tokens() -> None:
    request = recorded("gen-logprobs-decode-base.request.json")
    reply = read_generate_reply(raw("gen-logprobs-decode-base.json"))
    assert reply.logprobs is not None and request["top_logprobs_num"] == 5
    assert [e.token_id for e in reply.logprobs.output_token] == reply.output_ids and len(reply.output_ids) == 24
    assert all(top[0].token_id == e.token_id for top, e in zip(reply.logprobs.output_top, reply.logprobs.output_token, strict=True))
    assert reply.logprobs.input_token == [] or reply.logprobs.input_token[0].logprob is None


def test_the_verify_view_reads_real_decode_logprobs_beside_the_real_re_score() -> None:
    """verify_view on real answers (run 9's probe, SmolLM2 on the H200): the decode's own logprobs
    of its 24 tokens beside the gate's re-score of them. As if the reference had the re-score's
    runner-up at the last position where the decode chose its top token, the view sets the two
    paths' disagreement there against how far they drift on the 23 tokens before it: at most
    0.0838 nats, the probe's own figure for this prompt (max |decode - re-score|)."""
    from tasks.gate.lossless import evidence_from_sglang, verify_view

    request = recorded("gen-logprobs-base.request.json")
    prompt, emitted = request["input_ids"][:382], request["input_ids"][382:]
    evidence = evidence_from_sglang(read_generate_reply(raw(LOGPROBS)).logprobs, prompt, emitted, 5)
    decode = read_generate_reply(raw("gen-logprobs-decode-base.json"))
    assert decode.output_ids == emitted
    d = 23
    (b, lb_rescore), (a, la_rescore) = evidence.positions[d].top[:2]
    assert b == emitted[d]
    reference = [*emitted[:d], a]
    div = {"position": d, "baseline_token": a, "speculative_token": b, "prefix": ""}
    v = verify_view(div, reference, evidence, decode.output_ids, decode.logprobs)
    assert v["reproduced"] and v["positions"] == d
    assert v["prefix_drift_max"] == pytest.approx(0.08375179767608643) and 0 < v["prefix_drift_mean"] < v["prefix_drift_max"]
    own = {e.token_id: e.logprob for e in decode.logprobs.output_top[d]}
    assert v["own_gap"] == pytest.approx(own[b] - own[a]) and v["rescore_gap"] == pytest.approx(la_rescore - lb_rescore)
    assert v["disagreement"] == pytest.approx(v["rescore_gap"] + v["own_gap"]) and abs(v["disagreement"]) < 0.2
    # Sent again, an answer that leaves the timed output before the divergence gives no view.
    other = [*decode.output_ids[:5], decode.output_ids[5] + 1, *decode.output_ids[6:]]
    assert verify_view(div, reference, evidence, other, decode.logprobs) == {"reproduced": False, "left_at": 5}


def test_a_speculative_server_answers_logprobs_that_the_verify_view_reads() -> None:
    """Real SGLang 0.5.14 under EAGLE3 (run 12): the decode's own logprobs for all 256 tokens (the
    verify forward's for those it accepted) and the same server's prefill re-score of them. Read
    as the gate reads them, the verify path against the prefill path drifts by at most 0.1565
    nats on this prompt, the probe's recorded figure, and each token is its verify's best."""
    from tasks.gate.lossless import evidence_from_sglang, verify_view

    decode = read_generate_reply(raw("gen-logprobs-decode-eagle3.json"))
    assert decode.meta["spec_verify_ct"] == 120 and len(decode.output_ids) == 256 and decode.logprobs is not None
    assert [e.token_id for e in decode.logprobs.output_token] == decode.output_ids
    # Each emitted token is its verify's best (at position 75 tied to the last bit with the one listed first).
    assert all(top[0].logprob == e.logprob for top, e in zip(decode.logprobs.output_top, decode.logprobs.output_token,
                                                             strict=True))  # fmt: skip
    request = recorded("gen-logprobs-eagle3.request.json")
    prompt = request["input_ids"][: -len(decode.output_ids)]
    assert request["input_ids"][len(prompt):] == decode.output_ids and len(prompt) == 382
    evidence = evidence_from_sglang(read_generate_reply(raw("gen-logprobs-eagle3.json")).logprobs, prompt,
                                    decode.output_ids, 5)  # fmt: skip
    d = len(decode.output_ids) - 1  # as if the reference left it at the last token, for its runner-up there
    b, a = decode.output_ids[d], next(t for t, _ in evidence.positions[d].top if t != decode.output_ids[d])
    div = {"position": d, "baseline_token": a, "speculative_token": b, "prefix": ""}
    v = verify_view(div, [*decode.output_ids[:d], a], evidence, decode.output_ids, decode.logprobs)
    assert v["reproduced"] and v["positions"] == 255 and v["prefix_drift_max"] <= 0.15648716688156128 + 1e-12
    assert v["prefix_drift_mean"] < 0.02


def test_the_probe_sums_every_position_s_delta_by_nearest_rank() -> None:
    from gpunode.logprob_probe import delta_quantiles

    assert delta_quantiles([]) == {"positions": 0}
    got = delta_quantiles([i / 100 for i in range(200, 0, -1)])  # 0.01 .. 2.00, unsorted
    assert got == {"positions": 200, "p50": 1.0, "p99": 1.98, "max": 2.0}


@pytest.mark.parametrize(("path", "value", "message"), [
    (("input_top_logprobs", 2, 1), ["-0.7", 1464, None], r"meta_info\.input_top_logprobs\[2\]\[1\]: logprob must be a number <= 0"),
    (("input_token_logprobs", 1), [-0.01, 985], r"meta_info\.input_token_logprobs\[1\] must be \[logprob, token_id, text\]"),
    (("input_token_logprobs", 2), [None, 1464, None], r"meta_info\.input_token_logprobs\[2\]: logprob is null"),
    (("output_top_logprobs", 0, 0), [-0.9, -3, None], r"meta_info\.output_top_logprobs\[0\]\[0\]: token_id must be"),
    (("input_top_logprobs", 1), [[-4.9, 77, None], [-0.01, 985, None]], r"input_top_logprobs\[1\]: not sorted best first"),
    (("input_top_logprobs",), [None], r"input_top_logprobs has 1 positions, input_token_logprobs 25"),
    (("output_token_logprobs",), None, r"meta_info has input_token_logprobs but no output_token_logprobs"),
])  # fmt: skip
def test_a_malformed_logprob_field_is_refused_by_name(path: tuple, value: Any, message: str) -> None:
    body = recorded(LOGPROBS)
    *parents, last = path
    node = body["meta_info"]
    for key in parents:
        node = node[key]
    if value is None:
        del node[last]
    else:
        node[last] = value
    with pytest.raises(MalformedResponse, match=message):
        read_generate_reply(json.dumps(body).encode())


def _record() -> RequestRecord:
    return RequestRecord("eagle3-s2-k1-n3", "default", 0, 0, "p0", "chat", latency_s=0.5)


def test_the_gate_records_the_recorded_answers() -> None:
    """Per-request numbers from the real EAGLE3 answer (2 steps, topk 1, 3 draft tokens)."""
    spec = SpecParams("/d", num_steps=2, topk=1, num_draft_tokens=3)
    rec = _record()
    ids = record_generate_answer(rec, 200, raw("gen-eagle3.json"), spec)
    assert ids == recorded("gen-eagle3.json")["output_ids"] and rec.error is None
    assert (rec.finish, rec.completion_tokens, rec.spec_verify_ct) == ("stop", 23, 21)
    # Ours leaves out the first token (from prefill): (23 - 1) / 21. SGLang's own reads 23 / 21.
    assert rec.accept_length == pytest.approx(22 / 21)
    assert recorded("gen-eagle3.json")["meta_info"]["spec_accept_length"] == pytest.approx(23 / 21)
    # SGLang 0.5.14 cut the histogram after its last non-zero count; the record has num_steps + 1.
    assert rec.correct_drafts_histogram == [20, 1, 0]
    assert rec.tok_s == pytest.approx(23 / 0.5) and rec.server_e2e_latency_s == pytest.approx(0.11240540799985865)

    base = _record()
    base_ids = record_generate_answer(base, 200, raw("gen-base.json"), None)
    assert base_ids == ids and base.output_sha == rec.output_sha
    assert (base.spec_verify_ct, base.accept_length, base.correct_drafts_histogram) == (None, None, None)

    overlong = _record()
    assert record_generate_answer(overlong, 400, raw("gen-overlong-base.json"), None) is None
    assert overlong.error is not None and overlong.error.startswith(
        "HTTP 400: Requested token count exceeds the model's maximum context length of 2048 tokens.")  # fmt: skip


def test_the_recorded_random_draft_reads_as_stuck() -> None:
    """The batched EAGLE3 answers came from a random draft: nothing accepted in 7 verifies of 8
    tokens. By our definition that is exactly 1.0 (SGLang's own says 1.14), and the gate stops
    with the EAGLE-vs-EAGLE3 diagnosis."""
    spec = SpecParams("/d", num_steps=2, topk=1, num_draft_tokens=3)
    records = []
    for item in recorded("genbatch-eagle3.json"):
        rec = _record()
        record_generate_answer(rec, 200, json.dumps(item).encode(), spec)
        assert (rec.accept_length, rec.correct_drafts_histogram) == (1.0, [7, 0, 0])
        assert item["meta_info"]["spec_accept_length"] == pytest.approx(8 / 7)
        records.append(rec)
    with pytest.raises(GateStopped, match=re.escape(STUCK_DIAGNOSIS)):
        check_acceptance(1.3, BenchConfig(spec.label, spec, "default"), records, "after warm-up")


def test_the_gate_reads_the_recorded_logs() -> None:
    base = parse_server_log((FIX / "server-log-excerpt.txt").read_text())
    none = {"begin": 0, "end": 0}
    assert base.captures == {"target": {"begin": 1, "end": 1}, "draft": none, "draft_extend": none,
                             "prefill": {"begin": 1, "end": 1}}  # fmt: skip
    assert [(d.accept_len, d.cuda_graph, d.gen_throughput) for d in base.decode] == [(None, True, 13.09), (None, True, 577.95)]
    assert base.graph_problems(speculative=False) == []

    spec = parse_server_log((FIX / "server-log-eagle3-excerpt.txt").read_text())
    one = {"begin": 1, "end": 1}
    assert spec.captures == {"target": one, "draft": one, "draft_extend": one, "prefill": none}
    assert [(d.accept_len, d.cuda_graph) for d in spec.decode] == [(1.0, True)] * 4
    assert spec.graph_problems(speculative=True, num_steps=3) == []
    assert spec.to_dict()["mean_logged_accept_len"] == 1.0


def test_the_gate_reads_a_launchs_start_up_from_a_real_log(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run 24's first 3-step launch (its log as `node wait` brought it back, on an H100): ready
    after 61 s, of which ~41 s passed before the scheduler process wrote its first line (the
    server's two processes importing SGLang), then the weights (3 s) and the CUDA graphs (12 s).
    Each phase is read from the log's own times, to the second, against the launch's start."""
    import tarfile
    import time

    results = Path(__file__).resolve().parents[1] / "benchmarks/results/real-run-node/run-24/results.tar.gz"
    with tarfile.open(results) as tar:
        text = tar.extractfile("server-logs/001-eagle3-s3-k1-n4-rep0.log").read().decode()
        report = json.load(tar.extractfile("run/gate/report.json"))
    started_at = report["bench"]["launches"][1]["started_at"]
    # SGLang writes the local time of the machine it runs on, where the gate reads it: the node's
    # was UTC, whatever this machine's is.
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    try:
        startup = parse_server_log(text).to_dict(started_at)["startup_s"]
    finally:
        monkeypatch.undo()
        time.tzset()
    assert list(startup) == ["first_line", "server_args", "scheduler", "weights_loaded", "graphs_captured", "ready"]
    assert [round(startup[k]) for k in startup] == [19, 21, 41, 44, 56, 59]
    # the launch's own clock (its health check answered) agrees: ready after 61.0 s
    assert startup["ready"] <= report["bench"]["launches"][1]["health_s"] < startup["ready"] + 3
    # a log without times (the recorded excerpts' older form) has no start-up, and says nothing of it
    assert "startup_s" not in parse_server_log("Decode batch, accept len: 1.00, cuda graph: True\n").to_dict(started_at)


# --- the compatible server answers with the recorded keys ----------------------------------------


@pytest.fixture
def compat() -> Iterator[ServerThread]:
    with start_server_thread(step_latency_s=0.0, context_length=2048, skip_tokenizer_init=True) as s:
        yield s


def test_the_compatible_server_answers_with_the_recorded_keys(compat: ServerThread) -> None:
    with httpx.Client(trust_env=False, timeout=30) as client:
        one = client.post(compat.url + "/generate", json={"input_ids": list(range(5, 13)), "rid": "probe-1",
                                                           "sampling_params": {"max_new_tokens": 23}})  # fmt: skip
        assert one.status_code == 200
        assert key_sets(one.json()) == key_sets(recorded("gen-base.json"))
        assert "text" not in one.json()
        batch = client.post(compat.url + "/generate", json={"input_ids": [[5, 6, 7], [8, 9, 10, 11]],
                                                             "sampling_params": {"max_new_tokens": 8}})  # fmt: skip
        assert [key_sets(x) for x in batch.json()] == [key_sets(x) for x in recorded("genbatch-base.json")]
        overlong = client.post(compat.url + "/generate", json=OVERLONG)
        assert overlong.status_code == 400 and overlong.json() == recorded("gen-overlong-base.json")
        text = client.post(compat.url + "/generate", json={"text": "hello"})
        assert text.status_code == 400 and "--skip-tokenizer-init" in text.json()["error"]["message"]
    with start_server_thread(step_latency_s=0.0) as tokenizing, httpx.Client(trust_env=False, timeout=30) as client:
        answer = client.post(tokenizing.url + "/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4}})
        top, meta = key_sets(answer.json())
        assert top == {"text", *recorded("gen-base.json")} and meta == set(recorded("gen-base.json")["meta_info"])


# --- the speculative emulator answers and logs like 0.5.14 ----------------------------------------


def templates(log: str) -> set[str]:
    """Log lines of 0.5.14's shape ("[date time] message", no rank on one GPU) with their numbers
    and number lists blanked, so wording is compared and values are not."""
    out = set()
    for line in log.splitlines():
        m = re.fullmatch(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] (.*)", line)
        if m:
            out.add(re.sub(r"\d+(?:\.\d+)?", "N", re.sub(r"\[[\d, ]*\]", "[L]", m.group(1))))
    return out


@pytest.mark.parametrize("speculative", [False, True], ids=["baseline", "eagle3"])
def test_the_emulator_answers_and_logs_like_0_5_14(speculative: bool, tmp_path: Path) -> None:
    spec = SpecParams("/drafts/d", num_steps=3, topk=1, num_draft_tokens=4) if speculative else None
    # Flags the emulator does not model but 0.5.14 lists are taken, as SGLang would.
    extra = ("--context-length", "2048", "--kv-cache-dtype", "fp8_e4m3", "--enable-metrics")
    launch_spec = LaunchSpec("/models/t", free_port(), spec=spec, server=H200, extra_args=extra)
    server = launch(EmulatedLauncher("0.5.14", {"decode_log_interval": 4}), launch_spec, tmp_path / "server.log")
    name = "eagle3" if speculative else "base"
    try:
        with httpx.Client(trust_env=False, timeout=30) as client:
            wait_healthy(server, client, timeout_s=60, poll_s=0.05)
            info = fetch_server_info(client, server.url, "0.5.14")
            assert check_server_info(info, launch_spec) == []
            assert (info["attention_backend"], info["skip_tokenizer_init"]) == ("triton", True)
            one = client.post(server.url + "/generate", json={"input_ids": list(range(5, 13)),
                                                             "sampling_params": {"max_new_tokens": 32}}).json()  # fmt: skip
            assert key_sets(one) == key_sets(recorded(f"gen-{name}.json"))
            batch = client.post(server.url + "/generate", json={"input_ids": [[5, 6, 7], [8, 9, 10, 11]],
                                                                 "sampling_params": {"max_new_tokens": 8}}).json()  # fmt: skip
            assert [key_sets(x) for x in batch] == [key_sets(x) for x in recorded(f"genbatch-{name}.json")]
            overlong = client.post(server.url + "/generate", json=OVERLONG)
            assert overlong.status_code == 400 and overlong.json() == recorded("gen-overlong-base.json")
            # The lossless rule's re-score: the same fields and shapes as SGLang's (the recorded answer).
            from tasks.gate.lossless import evidence_from_sglang, rescore_body

            reference = one["output_ids"]
            rescored = client.post(server.url + "/generate", json=rescore_body(list(range(5, 13)), reference, 3, "rs"))
            spec_keys = set(recorded(f"gen-{name}.json")["meta_info"]) - set(recorded("gen-base.json")["meta_info"])
            top, meta = key_sets(recorded(LOGPROBS))
            assert key_sets(rescored.json()) == (top, meta | spec_keys)
            evidence = evidence_from_sglang(read_generate_reply(rescored.content).logprobs, list(range(5, 13)), reference, 3)
            assert [v.token for v in evidence.positions] == [*reference, None] and evidence.argmax_flips() == 0
    finally:
        server.stop()
    if speculative:
        meta = one["meta_info"]
        hist = meta["spec_accept_histogram"]
        assert sum(hist) == meta["spec_verify_ct"] and len(hist) <= 4 and hist[-1] > 0  # cut like 0.5.14's
        assert meta["spec_num_proposed_drafts"] == 3 * meta["spec_verify_ct"]
        assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])
    log = server.log_text()
    wanted = templates((FIX / f"server-log{'-eagle3' if speculative else ''}-excerpt.txt").read_text())
    assert len(wanted) == (10 if speculative else 8)  # weights, captures, decode (and prefill) lines
    assert wanted <= templates(log), sorted(wanted - templates(log))
    assert parse_server_log(log).graph_problems(speculative, num_steps=3) == []


def test_the_emulator_honours_the_prefill_graph_setting(tmp_path: Path) -> None:
    settings = H200.model_copy(update={"disable_prefill_cuda_graph": True})
    launch_spec = LaunchSpec("/models/t", free_port(), server=settings)
    server = launch(EmulatedLauncher("0.5.14"), launch_spec, tmp_path / "server.log")
    try:
        with httpx.Client(trust_env=False, timeout=30) as client:
            wait_healthy(server, client, timeout_s=60, poll_s=0.05)
            assert fetch_server_info(client, server.url, "0.5.14")["disable_prefill_cuda_graph"] is True
    finally:
        server.stop()
    log = parse_server_log(server.log_text())
    assert log.captures["prefill"] == {"begin": 0, "end": 0} and log.captures["target"] == {"begin": 1, "end": 1}
    assert log.graph_problems(speculative=False) == []


def test_the_gate_runs_0_5_14_launches_with_the_h200_settings(tmp_path: Path) -> None:
    """The gate's own loop against 0.5.14 emulated launches: no info or graph problems, and the
    per-request records carry full-width histograms."""
    cfg = GateConfig(engine="emulated", sglang_version="0.5.14", server=H200, num_steps=[3], topk_points=[],
                     repetitions=2, num_prompts=2, max_new_tokens=16, warmup_requests=1, acceptance_floor=1.1,
                     health_timeout_s=60, health_poll_s=0.05, request_timeout_s=30)  # fmt: skip
    prompts = [BenchPrompt(i, f"p{i}", "chat", tuple(range(5 + i, 20 + i))) for i in range(2)]
    launcher = EmulatedLauncher("0.5.14", {"accept_probs": [0.9, 0.8, 0.7]})
    result = GateRunner(cfg, launcher, "/models/t", plan_configs(cfg, "/drafts/d"), prompts, tmp_path / "logs").run()
    assert result.stopped is None and len(result.launches) == 4
    for launched in result.launches:
        assert launched.info_problems == [] and launched.graph_problems == []
        # The settings reached the server, which echoes them as SGLang echoes its server args.
        assert (launched.server_info["skip_tokenizer_init"], launched.server_info["attention_backend"]) == (True, "triton")
        for rec in launched.requests:
            assert rec.error is None and rec.exact_match is True
            if launched.config != "baseline":
                assert rec.correct_drafts_histogram is not None and len(rec.correct_drafts_histogram) == 4
