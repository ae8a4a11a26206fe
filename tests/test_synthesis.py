"""Prompts the target writes (issue 50): the pre-query prefix, the request filters, near-copies
(MinHash and the strict held-out guard), discovery of a synthesized source with every slot
recorded, the config's checks, per-request seeds over SGLang's wire, and the synthesis through
generation's shards on the tiny target, exactly once. The whole DAG, kill -9 included:
tests/test_synthesis_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from tasks.config import DiscoverConfig, EagleScaleConfig, SourceConfig
from tasks.discover import MANIFEST_SCHEMA, discover_prompts, prompt_id_of
from tasks.discover.near_duplicates import (
    HeldOutGuard,
    NearDuplicates,
    jaccard,
    shingles,
    signature,
)
from tasks.discover.stage import discover_config_hash
from tasks.discover.synthesized import SynthesizedRequest, SynthesizedSet, request_problem
from tasks.engines.base import GenerationRequest, SamplingParams
from tasks.fingerprint_fields import run_fingerprint
from tasks.runfolder import RunFolder, ShardStore, content_hash
from tasks.synthesize.plan import PLAN_KEY, cut_slots, plan_slots, slot_id
from tasks.synthesize.stage import SynthesisStage, discover_with_synthesis
from tasks.target.model_dir import TargetError
from tasks.target.pre_query import pre_query_ids, pre_query_text
from tasks.target.tokenizer import load_tokenizer


def words(messages: list[dict[str, str]]) -> int:
    return sum(len(m["content"].split()) for m in messages)


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir: Path) -> Any:
    return load_tokenizer(str(tiny_target_dir))


# -- the start of a user turn ------------------------------------------------------------------


def test_the_pre_query_prefix_is_the_template_up_to_the_users_words(tokenizer: Any) -> None:
    assert pre_query_text(tokenizer, None, "tiny") == "<|begin_of_text|><|user|>\n"
    steered = pre_query_text(tokenizer, "You help with Python.", "tiny")
    assert steered == "<|begin_of_text|><|system|>\nYou help with Python.<|end|><|user|>\n"
    ids = pre_query_ids(tokenizer, None, "Write a", "tiny")
    assert tokenizer.decode(ids) == "<|begin_of_text|><|user|>\nWrite a"


@pytest.mark.parametrize(("template", "says"), [
    ("{% for m in messages %}{{ m['content'] }}|{{ m['content'] }}{% endfor %}", "2 times, not once"),
    ("{% for m in messages %}<{{ m['content']|length }}>{{ m['content'] }}{% endfor %}", "depends on that text"),
    ("{% for m in messages %}{% if m['role'] == 'user' %}U: {{ m['content'] }}{% endif %}{% endfor %}", "drops the system turn"),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "writes nothing before"),
])  # fmt: skip
def test_a_template_without_a_fixed_user_start_is_refused_naming_the_target(tokenizer: Any, template: str, says: str) -> None:
    tokenizer.chat_template = template  # load_tokenizer hands out a copy per call
    with pytest.raises(TargetError, match=says) as e:
        pre_query_text(tokenizer, "Steer." if says == "drops the system turn" else None, "org/target-7b")
    assert "org/target-7b" in str(e.value)


# -- the request filters -----------------------------------------------------------------------

SRC = SourceConfig(name="synth", kind="synthesized", domain="code", count=8, max_request_tokens=32)


@pytest.mark.parametrize(("request_", "reason"), [
    (SynthesizedRequest(0, "r", "   ", "stop", 0), "empty"),
    (SynthesizedRequest(0, "r", "Write a parser for", "length", 32), "truncated"),
    (SynthesizedRequest(0, "r", "Write a parser", "stop", 5, special_tokens=1), "non_text"),
    (SynthesizedRequest(0, "r", "Write a \ufffd parser", "stop", 5), "non_text"),
    (SynthesizedRequest(0, "r", "Write a\x07 parser", "stop", 5), "non_text"),
    (SynthesizedRequest(0, "r", "?!* -- ...", "stop", 5), "non_text"),
    (SynthesizedRequest(0, "r", "I\u2019m sorry, but I can't help with that.", "stop", 9), "refusal"),
    (SynthesizedRequest(0, "r", "As an AI language model, here is a poem", "stop", 9), "refusal"),
    (SynthesizedRequest(0, "r", "How do I parse JSON in Rust?\n", "stop", 9), None),
    (SynthesizedRequest(0, "r", "Wie parse ich JSON in Rust? 日本語も", "stop", 9), None),
])  # fmt: skip
def test_each_request_filter_names_its_reason(request_: SynthesizedRequest, reason: str | None) -> None:
    problem = request_problem(SRC, request_)
    assert (problem and problem[0]) == reason
    if problem:
        assert problem[1].startswith("slot 0: ")


# -- near-copies -------------------------------------------------------------------------------

BASE = "How do I reverse a singly linked list in Python without using extra memory for a new list"


def _index(texts: list[str], threshold: float = 0.8) -> NearDuplicates:
    return NearDuplicates([str(i) for i in range(len(texts))], [shingles(user(t)) for t in texts], threshold)


def test_minhash_finds_near_copies_at_the_threshold_and_nothing_below() -> None:
    reworded = BASE + " please"  # one 3-gram more: Jaccard 16/17
    changed = BASE.replace("reverse", "sort").replace("Python", "Rust").replace("memory", "space")
    shouted = BASE.upper() + "?!"  # punctuation and case do not make a copy new
    index = _index([BASE, reworded, changed, shouted])
    index.keep(0)
    assert jaccard(index.sets[0], index.sets[1]) == pytest.approx(16 / 17)
    hit = index.match(1)
    assert hit is not None and hit.key == "0" and hit.similarity == pytest.approx(16 / 17)
    assert jaccard(index.sets[0], index.sets[2]) < 0.5 and index.match(2) is None  # a third of the words changed
    assert index.match(3).similarity == 1.0
    # Only prompts kept before it count: a later one, or one not kept, is no match.
    assert _index([reworded, BASE]).match(1) is None
    # Deterministic: the same signature in every process (CRC-32 and a seeded hash family).
    assert signature(shingles(user(BASE))).tobytes() == signature(shingles(user(BASE))).tobytes()
    assert int(signature(np.array([1], dtype=np.uint32)).min()) == 224986769  # pinned: another run, another value fails


def test_minhash_recall_on_many_near_copies() -> None:
    texts = [f"Topic {i}: " + BASE + f" and then explain case number {i} in detail" for i in range(200)]
    index = _index(texts + [t + " thanks" for t in texts])
    for i in range(200):
        index.keep(i)
    # Each text with one word appended is found (Jaccard >= 0.9), as itself, not as a neighbour.
    found = [index.match(200 + i) for i in range(200)]
    assert [m.key if m else None for m in found] == [str(i) for i in range(200)]


def test_the_held_out_guard_is_exact_and_catches_a_copy_inside_a_longer_request() -> None:
    guard = HeldOutGuard([("held", user(BASE)), ("other", user("What is the capital of France"))], 0.5)
    inside = f"I have homework for my data structures class this week. {BASE}. Also tell me about graphs, trees and heaps."
    hit = guard.match(shingles(user(inside)))
    assert hit is not None and hit.key == "held" and hit.similarity == 1.0  # every held-out 3-gram is in it
    assert jaccard(shingles(user(inside)), shingles(user(BASE))) < 0.5  # Jaccard alone would let it pass
    half = " ".join(BASE.split()[:10]) + " in Haskell with recursion only"
    assert guard.match(shingles(user(half))).similarity >= 0.5
    assert guard.match(shingles(user("Write a haiku about the sea at night"))) is None
    # A short request sharing one common phrase with a held-out prompt is no copy of it (one 3-gram
    # of two shared: overlap 0.5 by the sets alone); a short held-out prompt inside a request is.
    long_held = HeldOutGuard([("held", user("how to use the python debugger to step through a loop"))], 0.5)
    assert long_held.match(shingles(user("how to use rsync"))) is None
    short_held = HeldOutGuard([("held", user("how to use rsync"))], 0.5)
    assert short_held.match(shingles(user("Tell me how to use rsync over ssh with a key"))).similarity == 1.0


# -- discovery of a synthesized source ---------------------------------------------------------

REAL = [
    "How do I sort a dictionary by value in Python and keep the order stable",
    "Explain the difference between a process and a thread in operating systems",
    "Write a SQL query that returns the second highest salary from a table",
    "What does the yield keyword do in a Python generator function exactly",
]


def _holdout_file(path: Path, texts: list[str], domain: str) -> str:
    rows = [{"prompt_id": prompt_id_of(user(t)), "source": "earlier", "domain": domain,
             "messages": json.dumps(user(t)), "n_tokens": words(user(t))} for t in texts]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows, schema=MANIFEST_SCHEMA), path)
    return str(path)


def _synthesized(texts: list[str | None]) -> SynthesizedSet:
    requests = [SynthesizedRequest(i, f"{i:024x}", error="http_400: bad") if t is None else
                SynthesizedRequest(i, f"{i:024x}", t, "stop", len(t.split())) for i, t in enumerate(texts)]  # fmt: skip
    return SynthesizedSet({"synth": requests}, {"requests": len(texts), "shards_total": 1, "completion_tokens": 99,
                                                "tokens_per_s": 33.0, "engine": "local"})  # fmt: skip


def test_every_slot_lands_in_one_table_and_a_held_out_near_copy_never_trains(tmp_path: Path) -> None:
    held = "Write a function that checks whether a string is a palindrome ignoring spaces"
    (tmp_path / "real.jsonl").write_text("".join(json.dumps({"messages": user(t)}) + "\n" for t in REAL))
    cfg = DiscoverConfig(
        sources=[SourceConfig(name="real", path=str(tmp_path / "real.jsonl"), domain="code"),
                 SourceConfig(name="synth", kind="synthesized", domain="code", count=9, system_prompt="Steer.",
                              system_turns="drop")],
        holdout_from=_holdout_file(tmp_path / "holdout.parquet", [held], "code"),
    )  # fmt: skip
    texts = [
        "Please " + held.lower() + ", in Python",  # the planted near-copy of the held-out prompt
        REAL[0],  # an exact copy of a real prompt: the real one stays
        REAL[1] + " briefly",  # a near copy of a real prompt
        "Implement a trie with insert, search and prefix counting in modern C++ code",
        "Implement a trie with insert, search and prefix counting in modern C++ code please",  # near the one before
        None,  # a dead letter
        "I'm sorry, but I cannot write that request for you today",
        "",  # empty
        "Design a rate limiter for an HTTP API using the token bucket algorithm in Go",
    ]
    result = discover_prompts(cfg, words, synthesized=_synthesized(texts))
    filtered = {(f["source"], f["row_index"]): f for f in result.filtered.to_pylist()}
    planted = filtered[("synth", 0)]
    assert planted["reason"] == "near_holdout" and planted["duplicate_of"] == prompt_id_of(user(held))
    assert "holdout_near_threshold 0.5" in planted["detail"]
    assert filtered[("synth", 1)]["reason"] == "duplicates_exact"
    assert filtered[("synth", 2)]["reason"] == "near_duplicate"
    assert filtered[("synth", 2)]["duplicate_of"] == prompt_id_of(user(REAL[1]))
    assert filtered[("synth", 4)]["reason"] == "near_duplicate"
    assert (filtered[("synth", 6)]["reason"], filtered[("synth", 7)]["reason"]) == ("refusal", "empty")
    assert [(q["row_index"], q["reason"]) for q in result.quarantine.to_pylist()] == [(5, "synthesis failed: http_400: bad")]
    # What trains: the real prompts and the two new synthesized ones, never the planted copy.
    kept = {json.loads(m)[-1]["content"] for m in result.manifest.column("messages").to_pylist()}
    assert kept == set(REAL) | {texts[3], texts[8]}
    assert not any("palindrome" in k for k in kept)
    assert all(json.loads(m)[0]["role"] == "user" for m in result.manifest.column("messages").to_pylist())  # drop
    counts = result.report["sources"]["synth"]
    assert {k: counts[k] for k in ("rows_read", "malformed", "empty", "refusal", "duplicates_exact", "near_holdout",
                                   "near_duplicate", "kept")} == {  # fmt: skip
        "rows_read": 9, "malformed": 1, "empty": 1, "refusal": 1, "duplicates_exact": 1, "near_holdout": 1,
        "near_duplicate": 2, "kept": 2}  # fmt: skip
    assert result.report["synthesis"]["kept_by_domain"] == {"code": {"real": 4, "synthesized": 2}}
    md = result.report_markdown()
    assert "## Real and synthesized prompts kept, per domain" in md and "| code | 4 | 2 | 33% |" in md
    assert "near holdout" in md and "33 tokens/s" in md


def test_a_synthesized_prompt_is_never_held_out(tmp_path: Path) -> None:
    (tmp_path / "real.jsonl").write_text(json.dumps({"messages": user(REAL[0])}) + "\n")
    cfg = DiscoverConfig(sources=[SourceConfig(name="real", path=str(tmp_path / "real.jsonl"), domain="code"),
                                  SourceConfig(name="synth", kind="synthesized", domain="code", count=4)],
                         holdout_per_domain=3)  # fmt: skip
    result = discover_prompts(cfg, words, synthesized=_synthesized([f"Task number {i}: build a {w} from scratch now"
                                                                     for i, w in enumerate(["lexer", "VM", "GC", "JIT"])]))  # fmt: skip
    assert result.holdout.column("source").to_pylist() == ["real"]
    assert sorted(result.manifest.column("source").to_pylist()) == ["synth"] * 4
    # Without a synthesized source the report keeps its columns of before.
    plain = discover_prompts(DiscoverConfig(sources=cfg.sources[:1], holdout_per_domain=0), words)
    assert plain.report["synthesis"] is None and "near holdout" not in plain.report_markdown()


def test_a_synthesized_config_discovered_without_its_synthesis_is_refused(tmp_path: Path) -> None:
    cfg = DiscoverConfig(sources=[SourceConfig(name="synth", kind="synthesized", domain="code", count=4)])
    with pytest.raises(ValueError, match="source 'synth' is synthesized, but no synthesis was given"):
        discover_prompts(cfg, words)


# -- the configuration -------------------------------------------------------------------------


def _config(**sections: Any) -> EagleScaleConfig:
    base: dict[str, Any] = {"run_root": "/runs/x", "target": {"model_path": "/models/x"},
                            "discover": {"sources": [{"name": "code", "path": "/d/c.jsonl", "domain": "code"}]}}  # fmt: skip
    return EagleScaleConfig.model_validate({**base, **sections})


@pytest.mark.parametrize(("source", "says"), [
    ({"name": "s", "kind": "synthesized", "domain": "d"}, "count is required"),
    ({"name": "s", "kind": "synthesized", "domain": "d", "count": 3, "path": "/x"}, "['path'] are settings of a file source"),
    ({"name": "s", "domain": "d", "path": "/x", "count": 3, "seed_text": "Hi"}, "['count', 'seed_text'] are settings of kind synthesized"),
    ({"name": "s", "domain": "d"}, "path is required"),
    ({"name": "a b", "kind": "synthesized", "domain": "d", "count": 3}, "names its shards"),
    ({"name": "s", "kind": "synthesized", "domain": "d", "count": 3, "temperature": 0}, "greater than 0"),
])  # fmt: skip
def test_a_source_is_checked_for_its_kind_when_the_config_loads(source: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError, match=says.replace("[", r"\[").replace("]", r"\]")):
        SourceConfig.model_validate(source)


def test_replies_to_their_end_are_checked_against_extract_max_length() -> None:
    ok = _config(sampling={"max_new_tokens_by_domain": {"code": 1024}},
                 discover={"sources": [{"name": "code", "path": "/d", "domain": "code"}], "max_prompt_tokens": 1024},
                 extract={"max_length": 2056})  # fmt: skip
    assert ok.sampling.max_new_tokens_for("code") == 1024 and ok.sampling.max_new_tokens_for() == 1024
    with pytest.raises(ValidationError) as e:
        _config(sampling={"max_new_tokens_by_domain": {"code": 1024, "chat": 64}},
                discover={"sources": [{"name": "code", "path": "/d", "domain": "code"}], "max_prompt_tokens": 1024},
                extract={"max_length": 2048})  # fmt: skip
    text = str(e.value)
    assert "sampling.max_new_tokens_by_domain: domain 'chat' is not the domain of any source" in text
    assert ("extract.max_length (2048) cuts domain 'code''s longest sequence: discover.max_prompt_tokens 1024 + "
            "sampling.max_new_tokens_by_domain.code 1024 + 8 for the turn terminator = 2056 tokens; set "
            "extract.max_length to at least 2056") in text
    # Unset, nothing is checked: runs sized before the key keep their max_length.
    assert _config(extract={"max_length": 64}).sampling.max_new_tokens_by_domain == {}


def test_runs_committed_before_synthesis_keep_their_hashes() -> None:
    # Hashes computed with the code before issue 50: a resumed run must not be rediscovered or
    # have its fingerprint refused because keys were added with their defaults.
    cfg = EagleScaleConfig.model_validate({
        "run_root": "/runs/legacy", "target": {"model_path": "/models/legacy"},
        "discover": {"sources": [{"name": "chat", "path": "/data/chat.jsonl", "domain": "chat", "min_latin_fraction": 0.9},
                                 {"name": "code", "path": "/data/code.jsonl", "domain": "code", "conversation_format": "prompt",
                                  "user_template": "Do: {prompt}", "domain_rules": [{"pattern": "def ", "domain": "code"}]}],
                     "max_prompt_tokens_by_domain": {"code": 2048}},
        "sampling": {"max_new_tokens": 128}})  # fmt: skip
    assert discover_config_hash(cfg, None) == "e9cc06aa1509535d"
    assert content_hash(run_fingerprint(cfg, {"t": 1}, "m") | {"code_version": "x"}, 16) == "ea3f28822acde95c"
    synth = cfg.model_copy(deep=True)
    synth.discover.sources.append(SourceConfig(name="s", kind="synthesized", domain="code", count=2))
    assert discover_config_hash(synth, None) != "e9cc06aa1509535d"


# -- seeds over the wire -----------------------------------------------------------------------


def test_sampled_requests_carry_their_seed_to_sglang_and_draw_what_the_local_engine_draws(tiny_target_dir: Path) -> None:
    from tasks.config import EngineConfig
    from tasks.engines.local import LocalEngine
    from tasks.engines.sglang_client import SGLangEngine
    from tasks.standins.server import start_server_thread

    sampled = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=12, seed=5)
    prefix = (0, 4)  # <|begin_of_text|><|user|>: what a synthesized slot is written from
    requests = [GenerationRequest(content_hash(i, 24), f"p{i}", 0, prefix, sampled) for i in range(1, 7)]
    assert requests[0].sglang_sampling()["sampling_seed"] == requests[0].seed()
    greedy = GenerationRequest("a" * 24, "p", 0, prefix, SamplingParams())
    assert "sampling_seed" not in greedy.sglang_sampling()  # greedy payloads are as before
    local = LocalEngine(str(tiny_target_dir), batch_size=4)
    ours = {o.request_id: o.output_ids for o in local.generate_batch(requests)}
    alone = {o.request_id: o.output_ids for o in local.generate_batch(requests[2:3])}  # batching changes nothing
    assert alone[requests[2].request_id] == ours[requests[2].request_id]
    assert len({tuple(v) for v in ours.values()}) > 1  # per-request seeds: different prompts
    with start_server_thread(model_path=str(tiny_target_dir), max_batch=3) as server:
        engine = SGLangEngine(EngineConfig(kind="sglang", endpoints=[server.url], concurrency_per_server=3))
        served: dict[str, list[int]] = {}
        engine.generate(requests, lambda o: served.__setitem__(o.request_id, o.output_ids))
        engine.close()
    assert served == ours


# -- the synthesis through generation's shards -------------------------------------------------


def test_slot_ids_and_shards_are_stable_and_a_grown_count_keeps_its_shards(tmp_path: Path) -> None:
    first = cut_slots("synth", "abcdef0123456789", 10, 4)
    assert [(s.start, s.end) for s in first] == [(0, 4), (4, 8), (8, 10)]
    grown = cut_slots("synth", "abcdef0123456789", 14, 4)
    assert grown[:2] == first[:2] and grown[2].shard_id != first[2].shard_id
    assert first[0].planned("h1")[1].prompt_id == slot_id("synth", 1) == "synth#00000001"
    assert first[0].planned("h1")[1].request_id != first[0].planned("h2")[1].request_id
    run = RunFolder(str(tmp_path / "run"))
    src = SourceConfig(name="synth", kind="synthesized", domain="d", count=10)
    assert len(plan_slots(run, {"synth": (src, "h" * 16)}, 4)) == 3
    assert len(plan_slots(run, {"synth": (src, "h" * 16)}, 2)) == 3  # recorded size kept
    assert run.read_json(PLAN_KEY)["synth"]["shard_size"] == 4


def test_the_synthesis_runs_once_through_generation_shards_and_discovery_reads_it(tmp_path: Path, tiny_target_dir: Path) -> None:
    cfg = _tiny_config(tmp_path, tiny_target_dir)
    run = RunFolder(cfg.run_root)
    tok = load_tokenizer(str(tiny_target_dir))
    first = discover_with_synthesis(cfg, run, tok)
    store = ShardStore(run, "synthesize")
    markers = store.committed()
    assert len(markers) == 3 and store.is_complete()
    rows = [r for m in markers.values() for r in store.read_rows(m).to_pylist()]
    assert sorted(r["prompt_id"] for r in rows) == [slot_id("synth", i) for i in range(12)]
    synth = first["report"]["sources"]["synth"]
    assert synth["rows_read"] == 12 and synth["kept"] + sum(synth[k] for k in ("truncated", "non_text", "empty")) <= 12
    assert first["report"]["synthesis"]["summary"]["requests"] == 12
    # Again with discovery's marker gone: the synthesis is read back, nothing sent (no engine opens).
    run.remove("prompts/_SUCCESS.json")

    def no_engine() -> Any:
        raise AssertionError("a committed synthesis sent a request again")

    again = discover_with_synthesis(cfg, run, tok, engine=no_engine)
    assert again["report"]["sources"]["synth"] == synth and {s: m["attempt"] for s, m in store.committed().items()} == {
        s: m["attempt"] for s, m in markers.items()}  # fmt: skip
    stage = SynthesisStage(cfg, run, tok, engine=no_engine)
    assert stage.prepare() == []


def _tiny_config(tmp_path: Path, model_dir: Path) -> EagleScaleConfig:
    (tmp_path / "real.jsonl").write_text("".join(json.dumps({"messages": user(t)}) + "\n" for t in REAL))
    return EagleScaleConfig.model_validate({
        "run_root": str(tmp_path / "run"), "target": {"model_path": str(model_dir)},
        "discover": {"sources": [{"name": "real", "path": str(tmp_path / "real.jsonl"), "domain": "code"},
                                 {"name": "synth", "kind": "synthesized", "domain": "code", "count": 12,
                                  "max_request_tokens": 24, "temperature": 0.7, "top_k": 20}],
                     "holdout_per_domain": 1},
        "engine": {"batch_size": 12}, "generate": {"shard_size": 5},
    })  # fmt: skip
