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
