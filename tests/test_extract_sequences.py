"""Training sequences from committed generation rows of a real run on the tiny target."""

from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pytest

from tasks.discover.commit import read_prompts_table
from tasks.extract.sequences import (
    ChatTemplateMismatch,
    SequenceBuilder,
    eval_prompt_ids,
    terminator_ids,
    turn_completion,
)
from tasks.runfolder import RunFolder, ShardStore
from tasks.target.tokenizer import load_tokenizer, render_prompt_ids
from tests.extract_support import generated_run

VOCAB = 2048


@pytest.fixture
def gen(tmp_path_factory, tmp_path, tiny_target_dir):
    cfg, _ = generated_run(tmp_path_factory.getbasetemp(), tiny_target_dir, tmp_path)
    run = RunFolder(cfg.run_root)
    store = ShardStore(run, "generate")
    rows = pa.concat_tables([store.read_rows(m) for _, m in sorted(store.committed().items())])
    manifest = read_prompts_table(run, "manifest")
    messages = dict(
        zip(
            manifest.column("prompt_id").to_pylist(),
            manifest.column("messages").to_pylist(),
            strict=True,
        )
    )
    return run, load_tokenizer(cfg.target.model_path), rows, messages


def test_mask_covers_the_response_and_the_template_terminator_only(gen):
    run, tok, rows, messages = gen
    built = SequenceBuilder(run, tok, max_length=4096, vocab_size=VOCAB).build(rows)
    eos = tok.eos_token_id
    assert terminator_ids(tok) == [eos]
    by_id = {r["request_id"]: r for r in rows.to_pylist()}
    assert built.dead == [] and len(built.sequences) == rows.num_rows
    reasons = Counter()
    for seq in built.sequences:
        row = by_id[seq.sequence_id]
        prompt = render_prompt_ids(tok, json.loads(messages[row["prompt_id"]]))
        out = row["output_ids"]
        # The output ids are kept as generated (never re-tokenized) and the eos the template
        # writes after a reply is added only when the output does not already end with it.
        expected = prompt + out + ([] if out[-1] == eos else [eos])
        assert seq.input_ids == expected
        assert seq.loss_mask == [0] * len(prompt) + [1] * (len(expected) - len(prompt))
        reasons[row["finish_reason"]] += 1
    assert reasons["stop"] > 0 and reasons["length"] > 0, reasons
    assert built.stats["loss_tokens"] == sum(sum(s.loss_mask) for s in built.sequences)

    # Every sequence reads as the template's rendering of the whole conversation. (Text, not
    # ids: a random model's output ids are not what re-tokenizing their text would give.)
    for seq in built.sequences[:8]:
        row = by_id[seq.sequence_id]
        reply = tok.decode([t for t in row["output_ids"] if t != eos])
        conversation = [
            *json.loads(messages[row["prompt_id"]]),
            {"role": "assistant", "content": reply},
        ]
        assert tok.decode(seq.input_ids) == tok.apply_chat_template(conversation, tokenize=False)


def test_truncation_is_counted_and_prompts_without_room_are_dead(gen):
    run, tok, rows, messages = gen
    max_length = 60
    built = SequenceBuilder(run, tok, max_length=max_length, vocab_size=VOCAB).build(rows)
    eos = tok.eos_token_id
    want_truncated, want_dead = 0, set()
    for row in rows.to_pylist():
        p = len(render_prompt_ids(tok, json.loads(messages[row["prompt_id"]])))
        total = p + len(row["output_ids"]) + (row["output_ids"][-1] != eos)
        if p >= max_length:
            want_dead.add(row["request_id"])
        elif total > max_length:
            want_truncated += 1
    assert want_truncated > 0 and want_dead, "the fixture data must exercise both cases"
    assert built.stats["truncated"] == want_truncated
    assert sum(s.truncated for s in built.sequences) == want_truncated
    assert {d["request_id"] for d in built.dead} == want_dead
    assert {d["error_class"] for d in built.dead} == {"prompt_too_long"}
    assert all("max_length 60" in d["message"] for d in built.dead)
    assert max(len(s.input_ids) for s in built.sequences) == max_length
    assert all(len(s.input_ids) == len(s.loss_mask) and 1 in s.loss_mask for s in built.sequences)


def test_changed_chat_template_is_refused(gen):
    run, tok, _, _ = gen
    recorded = run.read_json("run.json")["fingerprint"]["target"]["chat_template_hash"]
    tok.chat_template = tok.chat_template.replace("<|end|>", "<|end|>\n")
    with pytest.raises(ChatTemplateMismatch) as err:
        SequenceBuilder(run, tok, max_length=256, vocab_size=VOCAB)
    assert recorded[:16] in str(err.value) and "target.chat_template" in str(err.value)


def test_split_is_seeded_per_domain_and_per_prompt(gen):
    run, tok, rows, _ = gen
    manifest = read_prompts_table(run, "manifest")
    domains = dict(
        zip(
            manifest.column("prompt_id").to_pylist(),
            manifest.column("domain").to_pylist(),
            strict=True,
        )
    )
    a = SequenceBuilder(run, tok, 256, VOCAB, eval_fraction=0.25, seed=3)
    b = SequenceBuilder(run, tok, 256, VOCAB, eval_fraction=0.25, seed=3)
    c = SequenceBuilder(run, tok, 256, VOCAB, eval_fraction=0.25, seed=4)
    assert a.eval_ids == b.eval_ids and a.eval_ids != c.eval_ids
    per_domain = Counter(domains[p] for p in a.eval_ids)
    assert per_domain == {d: round(0.25 * n) for d, n in Counter(domains.values()).items()}

    # Two samples of one prompt land on the same side, whichever side that is.
    row = rows.slice(0, 1).to_pylist()[0]
    twins = pa.Table.from_pylist([{**row, "request_id": "a" * 24}, {**row, "request_id": "b" * 24}])
    for builder in (a, c):
        built = builder.build(twins)
        assert len({s.split for s in built.sequences}) == 1
        assert built.sequences[0].split == (
            "eval" if row["prompt_id"] in builder.eval_ids else "train"
        )
    assert len(eval_prompt_ids({"x": ["p1", "p2", "p3"]}, 0.01, 0)) == 1  # at least one per domain
    assert eval_prompt_ids({"x": ["p1", "p2"]}, 0.0, 0) == set()


def test_rows_that_cannot_be_built_become_dead_letters_with_a_reason(gen):
    run, tok, rows, _ = gen
    row = rows.slice(0, 1).to_pylist()[0]
    bad = pa.Table.from_pylist(
        [
            {**row, "request_id": "1" * 24, "output_ids": [5, VOCAB + 7]},
            {**row, "request_id": "2" * 24, "prompt_id": "no-such-prompt"},
            {**row, "request_id": "3" * 24, "prompt_tokens": row["prompt_tokens"] + 1},
            {**row, "request_id": "4" * 24},
        ]
    )
    built = SequenceBuilder(run, tok, 4096, VOCAB).build(bad)
    assert [s.sequence_id for s in built.sequences] == ["4" * 24]
    assert {d["request_id"]: d["error_class"] for d in built.dead} == {
        "1" * 24: "invalid_token",
        "2" * 24: "unknown_prompt",
        "3" * 24: "prompt_mismatch",
    }
    assert built.stats["dead_classes"] == {
        "invalid_token": 1,
        "unknown_prompt": 1,
        "prompt_mismatch": 1,
    }


def test_turn_completion_appends_only_what_the_output_lacks():
    chatml_end = [7, 9]  # e.g. <|im_end|> then "\n"
    assert turn_completion([1, 2, 7], chatml_end) == [9]
    assert turn_completion([1, 2, 7, 9], chatml_end) == []
    assert turn_completion([1, 2, 3], chatml_end) == [7, 9]
    assert turn_completion([], chatml_end) == [7, 9]


def test_prompts_rendered_together_are_the_ids_one_at_a_time_and_a_bad_one_stays_alone(gen):
    """render_many_prompt_ids encodes a shard's prompts in one call: the same ids as one call
    each, and a prompt that cannot be rendered gets its error in its place, the others their ids;
    in a shard's build that row alone becomes a dead letter."""
    from tasks.target.model_dir import TargetError
    from tasks.target.tokenizer import render_many_prompt_ids

    run, tok, rows, messages = gen
    many = [json.loads(m) for m in list(messages.values())[:12]]
    bad = [{"role": "user", "content": 5}]
    rendered = render_many_prompt_ids(tok, [*many[:6], bad, *many[6:]])
    assert isinstance(rendered[6], TargetError) and "content must be a string" in str(rendered[6])
    assert [*rendered[:6], *rendered[7:]] == [render_prompt_ids(tok, m) for m in many]

    builder = SequenceBuilder(run, tok, 4096, VOCAB)
    first = rows.slice(0, 1).to_pylist()[0]
    builder._messages[first["prompt_id"]] = json.dumps(bad)  # a manifest row the template cannot render
    built = builder.build(rows)
    assert [d["request_id"] for d in built.dead] == [r["request_id"] for r in rows.to_pylist()
                                                     if r["prompt_id"] == first["prompt_id"]]  # fmt: skip
    assert len(built.sequences) == rows.num_rows - len(built.dead) > 0


def _conversations(n: int, turns: int) -> tuple[dict[str, str], dict[str, str]]:
    """A manifest of `n` conversations with a prompt per user turn (discover's every_user):
    prompt_id -> messages (JSON), prompt_id -> domain (a conversation's turns may differ)."""
    from tasks.discover.formats import prompt_id_of

    messages, domains = {}, {}
    for c in range(n):
        turns_so_far: list[dict[str, str]] = [{"role": "system", "content": "be brief"}] if c % 3 == 0 else []
        for t in range(turns):
            turns_so_far = [*turns_so_far, {"role": "user", "content": f"conversation {c} turn {t}"}]
            pid = prompt_id_of(turns_so_far)
            messages[pid] = json.dumps(turns_so_far)
            domains[pid] = "coding" if (c + t) % 4 == 0 else "chat"
            turns_so_far = [*turns_so_far, {"role": "assistant", "content": f"reply {c}.{t}"}]
    return messages, domains


def test_the_held_out_split_holds_out_whole_conversations() -> None:
    """With a prompt per user turn, a split per prompt leaves other turns of most held-out
    conversations in training; by conversation none, at about the same size per domain. A run
    of first-turn prompts gets the same split either way, so its recorded digest still holds."""
    from tasks.extract.sequences import conversation_ids, holdout_digest, manifest_eval_ids

    messages, domains = _conversations(200, 4)
    conversations = conversation_ids(messages)
    assert len(set(conversations.values())) == 200
    first_turns = {p for p, m in messages.items() if len(json.loads(m)) in (1, 2)}  # [system,] user
    assert all(sum(c == conversations[p] for c in conversations.values()) == 4 for p in first_turns)
    assert {conversations[p] for p in first_turns} == set(conversations.values())

    def leaks(held: set[str]) -> int:
        return sum(1 for p in held if any(q not in held for q, c in conversations.items() if c == conversations[p]))

    per_prompt = manifest_eval_ids(domains, 0.05, 0)
    whole = manifest_eval_ids(domains, 0.05, 0, conversations)
    assert leaks(per_prompt) > 0 and leaks(whole) == 0
    counts = Counter(domains[p] for p in whole)
    for domain, n in Counter(domains.values()).items():
        assert round(0.05 * n) <= counts[domain] <= round(0.05 * n) + 4  # a conversation's turns at most past it
    assert manifest_eval_ids(domains, 0.05, 0, conversations) == whole  # seeded
    assert manifest_eval_ids(domains, 0.05, 1, conversations) != whole

    # One prompt a conversation, first turns or last: the same split either way.
    last_turns = {p for p, m in messages.items() if len(json.loads(m)) >= 7}
    for one_each in (first_turns, last_turns):
        singles = {p: messages[p] for p in one_each}
        assert conversation_ids(singles) == {p: p for p in one_each}
        single_domains = {p: domains[p] for p in one_each}
        alone = manifest_eval_ids(single_domains, 0.05, 0)
        assert manifest_eval_ids(single_domains, 0.05, 0, conversation_ids(singles)) == alone
        assert holdout_digest(alone) != holdout_digest(whole)


def test_a_split_other_than_the_recorded_one_is_named(gen) -> None:
    """holdout_changed: the digest a stage recorded against the split this run makes now. A
    record from before the key (None) holds where the prompt unit gives the same split (this
    run's first-turn prompts); another digest is refused with what to set."""
    from tasks.extract.sequences import holdout_changed

    run, tok, _, _ = gen
    by_conversation = SequenceBuilder(run, tok, 256, VOCAB, eval_fraction=0.25, seed=3)
    by_prompt = SequenceBuilder(run, tok, 256, VOCAB, eval_fraction=0.25, seed=3, holdout_unit="prompt")
    assert by_conversation.eval_ids == by_prompt.eval_ids and by_conversation.holdout == by_prompt.holdout
    assert holdout_changed(None, by_conversation, "here") is None
    assert holdout_changed(by_prompt.holdout, by_conversation, "here") is None
    other = SequenceBuilder(run, tok, 256, VOCAB, eval_fraction=0.25, seed=4)
    said = holdout_changed(other.holdout, by_conversation, "run/train/checkpoints/step-4")
    assert said is not None and said.startswith("run/train/checkpoints/step-4 was made with another held-out split")
    assert "extract.holdout_unit 'conversation'" in said
    with pytest.raises(ValueError, match="extract.holdout_unit 'turn'"):
        SequenceBuilder(run, tok, 256, VOCAB, holdout_unit="turn")


def test_a_record_from_before_the_key_holds_only_where_each_prompt_alone_splits_alike(gen) -> None:
    """The run's prompts made a prompt per user turn (each conversation one more turn, committed
    as discovery commits): by conversation the split is another than each prompt alone, so a
    record from before extract.holdout_unit is refused with what to set, and holds with it set."""
    from tasks.discover.commit import TABLES, commit_discovery, discovery_marker
    from tasks.discover.formats import prompt_id_of
    from tasks.discover.result import MANIFEST_SCHEMA
    from tasks.extract.sequences import holdout_changed
    from tasks.runfolder.fingerprint import canonical_json

    run, tok, _, _ = gen
    first = read_prompts_table(run, "manifest").to_pylist()
    later = []
    for row in first:
        turns = [*json.loads(row["messages"]), {"role": "assistant", "content": "Done."},
                 {"role": "user", "content": "And the tests?"}]  # fmt: skip
        later.append({**row, "prompt_id": prompt_id_of(turns), "messages": canonical_json(turns)})
    tables = {name: read_prompts_table(run, name) for name in TABLES}
    tables["manifest"] = pa.Table.from_pylist(sorted(first + later, key=lambda r: r["prompt_id"]), schema=MANIFEST_SCHEMA)
    commit_discovery(run, tables, {}, "", discovery_marker(run)["config_hash"])

    by_conversation = SequenceBuilder(run, tok, 256, VOCAB, eval_fraction=0.25, seed=3)
    by_prompt = SequenceBuilder(run, tok, 256, VOCAB, eval_fraction=0.25, seed=3, holdout_unit="prompt")
    assert len(by_conversation._messages) == 2 * len(first) and by_conversation.eval_ids != by_prompt.eval_ids
    said = holdout_changed(None, by_conversation, "run/train/data.json: the draft")
    assert said is not None and "set extract.holdout_unit to 'prompt' to go on with it" in said
    assert holdout_changed(None, by_prompt, "run/train/data.json: the draft") is None
