"""LocalEngine on the tiny target: greedy against an unbatched reference, seeded sampling,
finish reasons, dead letters, the sink contract and concurrent callers."""

from __future__ import annotations

import hashlib
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tasks.engines.base import (
    DeadLetter,
    EngineUnavailable,
    GenerationRequest,
    GenerationResult,
    Outcome,
    SamplingParams,
)
from tasks.engines.local import LocalEngine
from tasks.target.tokenizer import render_prompt_ids

PROMPTS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Write a function that reverses a linked list."}],
    [
        {"role": "system", "content": "You review code."},
        {"role": "user", "content": "def add(a, b):\n    return a - b\n\nWhat is wrong here?"},
    ],
    [{"role": "user", "content": "Summarize: " + "the cache retries failed requests. " * 20}],
    [
        {"role": "user", "content": "Explain recursion to a child."},
        {"role": "assistant", "content": "It is a thing that uses itself."},
        {"role": "user", "content": "Give an example."},
    ],
    [{"role": "user", "content": "SELECT name FROM users;"}],
    [{"role": "user", "content": "Translate 'good morning' into French and German."}],
    [{"role": "user", "content": "List three sorting algorithms " * 6}],
]
GREEDY = SamplingParams(max_new_tokens=24)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.95, top_k=64, max_new_tokens=24, seed=11)


@pytest.fixture(scope="module")
def engine(tiny_target_dir: Path):
    eng = LocalEngine(str(tiny_target_dir), batch_size=8)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompt_ids(engine: LocalEngine) -> list[list[int]]:
    return [render_prompt_ids(engine.tokenizer, m) for m in PROMPTS]


def make_requests(
    prompt_ids: list[list[int]], sampling: SamplingParams, sample_index: int = 0
) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            request_id=hashlib.sha256(f"p{i}/{sample_index}".encode()).hexdigest(),
            prompt_id=f"p{i}",
            sample_index=sample_index,
            input_ids=tuple(ids),
            sampling=sampling,
        )
        for i, ids in enumerate(prompt_ids)
    ]


def reference_greedy(model, prompt: list[int], max_new: int, eos_ids: frozenset[int]) -> list[int]:
    """Plain greedy decoding: a full forward pass per token, no cache, no batch, no padding."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(
                input_ids=torch.tensor([ids], device=model.device), use_cache=False
            ).logits
            token = int(logits[0, -1].argmax())
            out.append(token)
            ids.append(token)
            if token in eos_ids:
                break
    return out


def by_id(outcomes: list[Outcome]) -> dict[str, list[int]]:
    assert all(isinstance(o, GenerationResult) for o in outcomes)
    return {o.request_id: o.output_ids for o in outcomes}


def test_engine_attributes(engine: LocalEngine) -> None:
    assert engine.name == "local"
    assert engine.context_length == 2048
    assert engine.eos_ids == {engine.tokenizer.eos_token_id}


def test_greedy_equals_unbatched_reference(engine, prompt_ids, tiny_target_dir) -> None:
    lengths = {len(p) for p in prompt_ids}
    assert max(lengths) > 3 * min(lengths)  # one batch of 8 holds heavily padded rows
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target_dir), local_files_only=True)
    requests = make_requests(prompt_ids, GREEDY)
    outcomes = engine.generate_batch(requests)
    assert [o.request_id for o in outcomes] == [r.request_id for r in requests]
    for request, outcome in zip(requests, outcomes, strict=True):
        expected = reference_greedy(model, list(request.input_ids), 24, engine.eos_ids)
        assert outcome.output_ids == expected, request.prompt_id


def test_finish_reasons_and_result_fields(engine, prompt_ids) -> None:
    requests = make_requests(prompt_ids, SamplingParams(max_new_tokens=12))
    outcomes = engine.generate_batch(requests)
    eos = engine.tokenizer.eos_token_id
    reasons = []
    for request, o in zip(requests, outcomes, strict=True):
        assert isinstance(o, GenerationResult)
        reasons.append(o.finish_reason)
        # Nothing is generated after an eos; an eos as the 12th token still reads "length".
        assert eos not in o.output_ids[:-1]
        if o.finish_reason == "stop":
            assert o.output_ids[-1] == eos and len(o.output_ids) < 12
        else:
            assert o.finish_reason == "length" and len(o.output_ids) == 12
        assert o.text == engine.tokenizer.decode(o.output_ids, skip_special_tokens=True)
        assert "<|end|>" not in o.text
        assert (o.prompt_tokens, o.completion_tokens) == (len(request.input_ids), len(o.output_ids))
        assert o.server == "local" and o.latency_s > 0
    assert set(reasons) == {"stop", "length"}


def test_eos_as_the_last_allowed_token_finishes_with_length(engine, prompt_ids) -> None:
    # SGLang checks the length limit before the stop token; so do we.
    first = engine.generate_batch(make_requests(prompt_ids, GREEDY))
    stopped = next(o for o in first if o.finish_reason == "stop")
    index = [o.request_id for o in first].index(stopped.request_id)
    k = len(stopped.output_ids)
    again = engine.generate_batch(
        make_requests([prompt_ids[index]], SamplingParams(max_new_tokens=k))
    )[0]
    assert again.output_ids == stopped.output_ids
    assert again.finish_reason == "length"


def test_sampled_output_is_independent_of_batching(engine, prompt_ids, tiny_target_dir) -> None:
    sampled = make_requests(prompt_ids, SAMPLED)
    together = by_id(engine.generate_batch(sampled))
    single = LocalEngine(str(tiny_target_dir), batch_size=1)
    mixed = LocalEngine(str(tiny_target_dir), batch_size=3)
    try:
        alone = by_id(single.generate_batch(sampled[::-1]))
        # Interleaved with greedy requests of other prompts, in batches of 3.
        greedy = make_requests(prompt_ids, GREEDY, sample_index=1)
        interleaved = [r for pair in zip(greedy, sampled, strict=True) for r in pair]
        mixed_out = by_id(mixed.generate_batch(interleaved))
    finally:
        single.close()
        mixed.close()
    assert together == alone == {r.request_id: mixed_out[r.request_id] for r in sampled}

    greedy_out = by_id(engine.generate_batch(make_requests(prompt_ids, GREEDY)))
    assert list(together.values()) != list(greedy_out.values())
    reseeded = by_id(engine.generate_batch(make_requests(prompt_ids, replace(SAMPLED, seed=12))))
    assert list(together.values()) != list(reseeded.values())


def test_top_k_one_is_greedy(engine, prompt_ids) -> None:
    greedy = engine.generate_batch(make_requests(prompt_ids, GREEDY))
    top1 = engine.generate_batch(
        make_requests(
            prompt_ids, SamplingParams(temperature=1.5, top_k=1, max_new_tokens=24, seed=5)
        )
    )
    assert [o.output_ids for o in top1] == [o.output_ids for o in greedy]


def test_dead_letters_without_running(engine, prompt_ids) -> None:
    ok = make_requests(prompt_ids[:1], SamplingParams(max_new_tokens=4))[0]
    overflow = GenerationRequest(
        "ab" * 32, "long", 0, tuple([5] * 2000), SamplingParams(max_new_tokens=100)
    )
    out_of_vocab = GenerationRequest(
        "cd" * 32, "bad", 0, (1, engine.vocab_size + 7), SamplingParams(max_new_tokens=4)
    )
    empty = GenerationRequest("ef" * 32, "empty", 0, (), SamplingParams(max_new_tokens=4))
    bad_top_p = GenerationRequest(
        "01" * 32, "topp", 0, (1, 2), SamplingParams(temperature=1.0, top_p=0.0)
    )
    completed_before = engine.health()[0].completed
    outcomes = engine.generate_batch([overflow, ok, out_of_vocab, empty, bad_top_p])
    assert [type(o).__name__ for o in outcomes] == [
        "DeadLetter",
        "GenerationResult",
        "DeadLetter",
        "DeadLetter",
        "DeadLetter",
    ]
    dead = [o for o in outcomes if isinstance(o, DeadLetter)]
    assert [d.error_class for d in dead] == [
        "context_overflow",
        "invalid_input",
        "invalid_input",
        "invalid_input",
    ]
    assert "2000 tokens" in dead[0].message and "max_new_tokens 100" in dead[0].message
    assert "context length of 2048 tokens" in dead[0].message
    assert f"contains {engine.vocab_size + 7}" in dead[1].message
    assert dead[2].message == "input_ids is empty"
    assert "top_p=0.0" in dead[3].message
    assert engine.health()[0].completed == completed_before + 1


def test_generate_calls_sink_once_per_request_from_concurrent_callers(engine, prompt_ids) -> None:
    expected = by_id(engine.generate_batch(make_requests(prompt_ids, GREEDY)))
    overflow = GenerationRequest("9" * 64, "long", 0, tuple([5] * 2040), GREEDY)
    seen: list[Outcome] = []
    seen_lock = threading.Lock()

    def sink(outcome: Outcome) -> None:
        with seen_lock:
            seen.append(outcome)

    requests = make_requests(prompt_ids, GREEDY)
    threads = [
        threading.Thread(target=engine.generate, args=(requests[:5] + [overflow], sink)),
        threading.Thread(target=engine.generate, args=(requests[5:], sink)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(o.request_id for o in seen) == sorted([*expected, overflow.request_id])
    results = [o for o in seen if isinstance(o, GenerationResult)]
    assert {o.request_id: o.output_ids for o in results} == expected
    health = engine.health()[0]
    assert (health.healthy, health.in_flight, health.failures) == (True, 0, 0)


def test_closed_engine_is_unavailable(tiny_target_dir: Path) -> None:
    eng = LocalEngine(str(tiny_target_dir), batch_size=2, context_length=64)
    assert eng.context_length == 64
    eng.close()
    assert eng.health()[0].healthy is False
    with pytest.raises(EngineUnavailable, match="closed"):
        eng.generate(make_requests([[1, 2, 3]], GREEDY), lambda o: None)


def test_bad_constructor_arguments(tiny_target_dir: Path) -> None:
    with pytest.raises(ValueError, match="dtype must be one of .* got 'int8'"):
        LocalEngine(str(tiny_target_dir), dtype="int8")
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        LocalEngine(str(tiny_target_dir), batch_size=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_greedy_and_sampling(tiny_target_dir: Path, prompt_ids) -> None:
    batched = LocalEngine(str(tiny_target_dir), device="cuda", batch_size=8)
    single = LocalEngine(str(tiny_target_dir), device="cuda", batch_size=1)
    half = LocalEngine(str(tiny_target_dir), device="cuda", dtype="bfloat16", batch_size=8)
    try:
        requests = make_requests(prompt_ids, GREEDY)
        for request, outcome in zip(requests, batched.generate_batch(requests), strict=True):
            expected = reference_greedy(batched.model, list(request.input_ids), 24, batched.eos_ids)
            assert outcome.output_ids == expected, request.prompt_id
        sampled = make_requests(prompt_ids, SAMPLED)
        assert by_id(batched.generate_batch(sampled)) == by_id(single.generate_batch(sampled))
        for o in half.generate_batch(sampled):
            assert 0 < len(o.output_ids) <= 24 and o.finish_reason in {"stop", "length"}
    finally:
        for eng in (batched, single, half):
            eng.close()
