"""Row normalization and the content hashes: each format, each malformed case, exact outputs."""

from __future__ import annotations

import hashlib
import json

import pytest

from tasks.discover.formats import (
    MalformedRow,
    RowOptions,
    canonical_json,
    normalize_row,
    normalized_hash,
    prompt_id_of,
    row_prompts,
)


def system(c: str) -> dict[str, str]:
    return {"role": "system", "content": c}


def user(c: str) -> dict[str, str]:
    return {"role": "user", "content": c}


def bot(c: str) -> dict[str, str]:
    return {"role": "assistant", "content": c}


def test_openai_keeps_context_and_drops_trailing_answer() -> None:
    row = {
        "id": 7,
        "messages": [
            {"role": "system", "content": "Be brief.", "name": "sys"},
            user("Hi"),
            bot("Hello!"),
            user("What is 2+2?"),
            bot("4"),
        ],
    }
    assert normalize_row(row) == [
        system("Be brief."),
        user("Hi"),
        bot("Hello!"),
        user("What is 2+2?"),
    ]


def test_openai_text_parts_are_joined_and_developer_is_system() -> None:
    row = {
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "Rules."}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Part one."}, {"text": "Part two."}],
            },
        ]
    }
    assert normalize_row(row) == [system("Rules."), user("Part one.\nPart two.")]


def test_sharegpt_maps_roles_and_cuts_after_last_human() -> None:
    row = {
        "conversations": [
            {"from": "system", "value": "You are a coder."},
            {"from": "human", "value": "Fix the bug."},
            {"from": "gpt", "value": "Done."},
            {"from": "human", "value": "Add a test."},
            {"from": "gpt", "value": "Added."},
        ]
    }
    assert normalize_row(row, "sharegpt") == [
        system("You are a coder."),
        user("Fix the bug."),
        bot("Done."),
        user("Add a test."),
    ]


def test_sharegpt_with_role_content_items() -> None:
    row = {
        "conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    }
    assert normalize_row(row) == [user("Hi")]


def test_alpaca_instruction_input_system_and_history() -> None:
    assert normalize_row({"instruction": "Sum these.", "input": "1, 2", "output": "3"}) == [
        user("Sum these.\n\n1, 2")
    ]
    assert normalize_row({"instruction": "Say hi.", "input": "", "output": "hi"}) == [
        user("Say hi.")
    ]
    row = {
        "system": "Be kind.",
        "instruction": "And now?",
        "history": [["First?", "Yes."]],
        "output": "ok",
    }
    assert normalize_row(row) == [system("Be kind."), user("First?"), bot("Yes."), user("And now?")]


def test_bare_prompt_and_question_fields() -> None:
    assert normalize_row({"question": "Why is the sky blue?", "answer": "Rayleigh"}) == [
        user("Why is the sky blue?")
    ]
    assert normalize_row({"prompt": "Write a poem.", "system": "Rhyme."}) == [
        system("Rhyme."),
        user("Write a poem."),
    ]
    as_list = {"prompt": [user("Q1"), bot("A1"), user("Q2")], "chosen": "x"}
    assert normalize_row(as_list) == [user("Q1"), bot("A1"), user("Q2")]


def test_content_whitespace_is_kept_verbatim() -> None:
    # The target tokenizes exactly this text, so normalization must not touch it.
    assert normalize_row({"prompt": "  two  spaces\n"}) == [user("  two  spaces\n")]


@pytest.mark.parametrize(
    ("row", "fmt", "reason"),
    [
        ({"messages": [system("x"), bot("y")]}, "auto", "no user turn in messages"),
        (
            {"messages": [user("a"), {"role": "robot", "content": "b"}, user("c")]},
            "auto",
            "messages[1].role 'robot' unknown",
        ),
        (
            {"messages": [user("a"), bot("b"), {"role": "tool", "content": "c"}]},
            "auto",
            "messages[2].role 'tool' unknown",
        ),
        (
            {"messages": [{"role": "user", "content": 42}]},
            "auto",
            "messages[0].content is int, expected a string",
        ),
        ({"messages": [{"role": "user", "content": None}]}, "auto", "messages[0].content is null"),
        ({"messages": [user(" \n\t ")]}, "auto", "messages[0].content is empty"),
        ({"messages": [{"content": "hi"}]}, "auto", "messages[0].role missing or not a string"),
        ({"messages": "hello"}, "auto", "messages is str, expected a list"),
        ({"messages": []}, "auto", "messages is an empty list"),
        ({"messages": [user("a"), "b"]}, "auto", "messages[1] is str, expected an object"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "auto",
            "messages[0].content[0].type 'image_url' unsupported (only text parts)",
        ),
        (
            {
                "conversations": [
                    {"from": "human", "value": "a"},
                    {"from": "observation", "value": "b"},
                ]
            },
            "auto",
            "conversations[1].from 'observation' unknown",
        ),
        (
            {"conversations": [{"from": "gpt", "value": "a"}]},
            "auto",
            "no user turn in conversations",
        ),
        ({"instruction": "   ", "output": "x"}, "auto", "instruction is empty"),
        ({"instruction": "Do it", "input": 5}, "auto", "input is int, expected a string"),
        (
            {"instruction": "Do it", "history": [["only one"]]},
            "auto",
            "history[0] is not a [user, assistant] pair",
        ),
        ({"question": ["not", "messages"]}, "auto", "question[0] is str, expected an object"),
        (
            {"text": "hello", "id": 1},
            "auto",
            "no conversation field (expected messages, conversations, instruction, prompt or "
            "question; keys: id, text)",
        ),
        (["user", "hello"], "auto", "row is list, expected an object"),
        ({"prompt": "hi"}, "openai", "missing 'messages' field (conversation_format openai)"),
        (
            {"messages": [user("hi")]},
            "prompt",
            "missing 'prompt' or 'question' field (conversation_format prompt)",
        ),
    ],
)
def test_malformed_rows_name_the_problem(row: object, fmt: str, reason: str) -> None:
    with pytest.raises(MalformedRow) as err:
        normalize_row(row, fmt)
    assert str(err.value) == reason


def test_prompt_id_is_sha256_prefix_of_canonical_json() -> None:
    messages = [user("héllo"), bot("x"), user("y")]
    text = canonical_json(messages)
    assert (
        text == '[{"content":"héllo","role":"user"},{"content":"x","role":"assistant"},'
        '{"content":"y","role":"user"}]'
    )
    assert prompt_id_of(messages) == hashlib.sha256(text.encode()).hexdigest()[:20]
    reordered = json.loads(
        '[{"role":"user","content":"héllo"},{"content":"x","role":"assistant"},'
        '{"role":"user","content":"y"}]'
    )
    assert prompt_id_of(reordered) == prompt_id_of(messages)
    assert prompt_id_of([user("héllo ")]) != prompt_id_of([user("héllo")])


def test_normalized_hash_ignores_case_punctuation_and_spacing_but_not_roles() -> None:
    base = normalized_hash([user("What's the capital of France?")])
    assert normalized_hash([user("whats   the CAPITAL of france")]) == base
    assert normalized_hash([user("What's the capital\nof France!!")]) == base
    assert normalized_hash([user("What's the capital of Spain?")]) != base
    assert normalized_hash([system("What's the capital of France?")]) != base


def sg(*turns: tuple[str, str]) -> dict[str, object]:
    return {"conversations": [{"from": who, "value": text} for who, text in turns]}


FIRST = RowOptions(prompt_turns="first_user")
BANNER = "*This conversation is shared from [**ChatHub**](https://chathub.gg)*"


def test_first_user_turn_only_keeps_the_system_turn_before_it() -> None:
    row = sg(("system", BANNER), ("human", "Fix the bug."), ("gpt", "Done."), ("human", "More?"))
    assert normalize_row(row, "sharegpt", FIRST) == [system(BANNER), user("Fix the bug.")]
    drop = RowOptions(prompt_turns="first_user", system_turns="drop")
    assert normalize_row(row, "sharegpt", drop) == [user("Fix the bug.")]
    assert normalize_row(row, "sharegpt", RowOptions(system_turns="drop")) == [
        user("Fix the bug."),
        bot("Done."),
        user("More?"),
    ]
    alpaca = {"system": "Be kind.", "instruction": "And now?", "history": [["First?", "Yes."]]}
    assert normalize_row(alpaca, "auto", FIRST) == [system("Be kind."), user("First?")]


def test_leading_assistant_turns_are_dropped() -> None:
    # ShareGPT V3's split file starts most continuation chunks (id suffix _1, _2, ...) with
    # the answer that ended the previous chunk.
    row = sg(("gpt", "...end of an answer."), ("human", "Shorter."), ("gpt", "Ok."), ("human", "Go"))
    assert normalize_row(row, "sharegpt") == [user("Shorter."), bot("Ok."), user("Go")]
    assert normalize_row(row, "sharegpt", FIRST) == [user("Shorter.")]
    after_system = sg(("system", "S"), ("gpt", "Hi, I am a bot."), ("human", "Hello"))
    assert normalize_row(after_system, "sharegpt") == [system("S"), user("Hello")]


def test_empty_turns_count_only_inside_the_prompt_kept() -> None:
    after_prompt = sg(("human", "Question"), ("gpt", ""), ("human", ""), ("gpt", "?"))
    assert normalize_row(after_prompt, "sharegpt", FIRST) == [user("Question")]
    # through_last_user: trailing empty user turns (and answers to them) end the conversation.
    trailing = sg(("human", "A"), ("gpt", "B"), ("human", ""), ("gpt", "You didn't ask anything."))
    assert normalize_row(trailing, "sharegpt") == [user("A")]
    empty_system = {"messages": [system(" "), user("Hi")]}
    assert normalize_row(empty_system) == [user("Hi")]


@pytest.mark.parametrize(
    ("row", "options", "reason"),
    [
        (sg(("human", "A"), ("gpt", ""), ("human", "C")), RowOptions(), "conversations[1].value is empty"),
        (sg(("human", ""), ("gpt", "B"), ("human", "C")), RowOptions(), "conversations[0].value is empty"),
        (sg(("gpt", "x"), ("human", ""), ("gpt", "B"), ("human", "C")), FIRST, "conversations[1].value is empty"),
        (sg(("human", ""), ("gpt", "B"), ("human", " ")), RowOptions(), "conversations[0].value is empty"),
        (sg(("human", "A"), ("wizard", "B")), FIRST, "conversations[1].from 'wizard' unknown"),
        ({"messages": [{"role": "system", "content": None}, user("Hi")]}, RowOptions(), "messages[0].content is null"),
        (
            {"prompt": [user("Q1")]},
            RowOptions(user_template="Q: {prompt}"),
            "prompt is a message list; user_template applies to text prompts",
        ),
    ],
)  # fmt: skip
def test_malformed_under_options(row: object, options: RowOptions, reason: str) -> None:
    with pytest.raises(MalformedRow) as err:
        normalize_row(row, "auto", options)
    assert str(err.value) == reason


EVERY = RowOptions(prompt_turns="every_user", system_turns="drop")


def test_every_user_turn_gives_its_own_prompt_through_that_turn() -> None:
    row = sg(
        ("system", BANNER),
        ("gpt", "...end of an answer."),
        ("human", "Fix the bug."),
        ("gpt", "Done."),
        ("human", ""),  # nothing to answer: no prompt ends here
        ("gpt", "You didn't ask anything."),
        ("human", "Now test it."),
        ("gpt", "Tests pass."),
        ("human", " "),  # trailing empty turn
    )
    with pytest.raises(MalformedRow) as err:
        list(row_prompts(row, "sharegpt", EVERY))
    # The empty middle turn is context of the later prompt: it ends the row's prompts there,
    # and says from which user turn on.
    assert (str(err.value), err.value.user_turn) == ("conversations[4].value is empty", 2)
    prompts = []
    with pytest.raises(MalformedRow):
        for p in row_prompts(row, "sharegpt", EVERY):
            prompts.append(p)
    assert prompts == [(1, [user("Fix the bug.")])]  # the prompt before the broken turn stands

    clean = sg(("system", BANNER), ("human", "A"), ("gpt", "B"), ("human", "C"), ("gpt", "D"),
               ("human", "E"), ("gpt", "F"), ("human", ""))  # fmt: skip
    got = list(row_prompts(clean, "sharegpt", EVERY))
    assert got == [
        (1, [user("A")]),
        (2, [user("A"), bot("B"), user("C")]),
        (3, [user("A"), bot("B"), user("C"), bot("D"), user("E")]),
    ]
    # The first prompt is first_user's, the last through_last_user's, in every format.
    keep = RowOptions(prompt_turns="every_user")
    for fmt_row in (clean, {"messages": [system("S"), user("A"), bot("B"), user("C")]}):
        each = [m for _, m in row_prompts(fmt_row, "auto", keep)]
        assert each[0] == normalize_row(fmt_row, "auto", RowOptions(prompt_turns="first_user"))
        assert each[-1] == normalize_row(fmt_row, "auto", RowOptions())
    # A broken answer after the last prompt costs nothing; one between prompts ends them there.
    assert len(list(row_prompts(sg(("human", "A"), ("gpt", "")), "sharegpt", EVERY))) == 1
    with pytest.raises(MalformedRow) as err:
        list(row_prompts(sg(("human", "A"), ("gpt", ""), ("human", "C")), "sharegpt", EVERY))
    assert (str(err.value), err.value.user_turn) == ("conversations[1].value is empty", 2)
    # A single-prompt mode names no turn.
    with pytest.raises(MalformedRow) as err:
        normalize_row(sg(("human", "A"), ("gpt", ""), ("human", "C")), "sharegpt")
    assert err.value.user_turn is None


def test_bing_and_bard_are_assistants() -> None:
    row = sg(("system", BANNER), ("human", "33?"), ("bing", "A number."), ("human", "And 666?"))
    assert normalize_row(row)[2] == bot("A number.")
    assert normalize_row(sg(("human", "Hi"), ("bard", "Hello"), ("human", "Bye")))[1] == bot("Hello")


def test_user_template_wraps_prompt_rows() -> None:
    stub = 'def add(a, b):\n    """Add two numbers."""\n'
    template = "Complete the following Python function:\n\n```python\n{prompt}```"
    row = {"task_id": "HumanEval/0", "prompt": stub, "entry_point": "add"}
    assert normalize_row(row, "prompt", RowOptions(user_template=template)) == [
        user(f"Complete the following Python function:\n\n```python\n{stub}```")
    ]
    literal = RowOptions(user_template="Return {'a': 1} for: {prompt}")
    assert normalize_row({"question": "x"}, "prompt", literal) == [user("Return {'a': 1} for: x")]


def test_each_format_is_one_table_entry_with_the_configs_names() -> None:
    from typing import get_args

    from tasks.config import ConversationFormat, FileFormat
    from tasks.discover.formats import CONVERSATION_FORMATS, detect_format
    from tasks.discover.sources import FILE_FORMATS

    assert [f.name for f in CONVERSATION_FORMATS] == [n for n in get_args(ConversationFormat) if n != "auto"]
    assert {f.name for f in FILE_FORMATS} | {"hf_disk"} == set(get_args(FileFormat)) - {"auto"}
    samples = {"messages": [{"role": "user", "content": "hi"}], "conversations": [{"from": "human", "value": "hi"}],
               "instruction": "hi", "prompt": "hi", "question": "hi"}  # fmt: skip
    for fmt in CONVERSATION_FORMATS:
        for field in fmt.fields:  # every marking field is detected as its format, and parses
            assert detect_format({field: samples[field]}) == fmt.name
            assert normalize_row({field: samples[field]}, fmt.name)[-1] == {"role": "user", "content": "hi"}
