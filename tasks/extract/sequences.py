"""Training sequences: each committed generation row, token for token as the target saw it.

input_ids = the prompt rendered with the run's chat template (the ids the generation stage
sent) + the row's `output_ids` (the ids the target produced, never re-tokenized text) +
whatever the template writes after an assistant reply that the output does not already end
with (the turn terminator, e.g. `<|eot_id|>` or `<|im_end|>\\n`). The loss mask is 1 on the
response tokens: the output and that terminator. Sequences longer than `max_length` are cut
and counted.

The held-out split is decided per prompt (all samples of a prompt fall on one side), per
domain, from a seeded hash ranking over the whole manifest, so it does not depend on which
generation shards have been committed so far. With `extract.holdout_unit` conversation (the
default) it holds out whole conversations: a prompt per user turn (discover's `prompt_turns:
every_user`) makes several prompts of one conversation, and a later turn's context holds the
earlier turns, so the other turns of a held-out prompt's conversation never train. A run of
first-turn prompts has one prompt a conversation, and both units give it the same split.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from tasks.discover.commit import read_prompts_table
from tasks.discover.formats import prompt_id_of
from tasks.errors import ExpectedFailure
from tasks.runfolder import RunFolder
from tasks.target.identity import chat_template_hash
from tasks.target.model_dir import TargetError
from tasks.target.tokenizer import render_many_prompt_ids, render_prompt_ids

_PROBE = [{"role": "user", "content": "ping"}]
_REPLY_SENTINEL = "EAGLESCALE-REPLY-SENTINEL"

SPLITS = ("train", "eval")


class ChatTemplateMismatch(RuntimeError, ExpectedFailure):
    """The tokenizer's chat template is not the one the generation stage rendered with."""


class UnbuildableSequence(ValueError):
    """A row that cannot become a training sequence; `error_class` goes to the dead letter."""

    def __init__(self, error_class: str, message: str) -> None:
        super().__init__(f"{error_class}: {message}")
        self.error_class = error_class


@dataclass
class TrainingSequence:
    sequence_id: str  # the generation row's request_id
    prompt_id: str
    domain: str
    split: str  # "train" | "eval"
    input_ids: list[int]
    loss_mask: list[int]  # 1 on response tokens
    truncated: bool


@dataclass
class ShardSequences:
    """What one generation shard yields: sequences, dead letters (with reasons) and counts."""

    sequences: list[TrainingSequence]
    dead: list[dict[str, Any]]
    stats: dict[str, Any] = field(default_factory=dict)


def check_chat_template(run: RunFolder, tokenizer: Any) -> str:
    """The template hash, refused when run.json recorded a different one for generation."""
    recorded = run.read_json("run.json")
    if recorded is None:
        raise FileNotFoundError(f"{run.url}/run.json is missing: run the generate stage first")
    expected = recorded["fingerprint"]["target"]["chat_template_hash"]
    actual = chat_template_hash(tokenizer)
    if actual != expected:
        raise ChatTemplateMismatch(
            f"the target tokenizer's chat template (sha256 {actual[:16]}...) differs from the one "
            f"the generation stage rendered prompts with (run.json target.chat_template_hash "
            f"{expected[:16]}...): training sequences would not match the generated data. Set "
            f"target.chat_template to the template used for generation."
        )
    return actual


def terminator_ids(tokenizer: Any) -> list[int]:
    """Tokens the chat template writes right after an assistant reply's content."""
    try:
        full = tokenizer.apply_chat_template(
            [*_PROBE, {"role": "assistant", "content": _REPLY_SENTINEL}],
            add_generation_prompt=False,
            tokenize=False,
        )
    except Exception as e:  # jinja raises its own exception types
        raise TargetError(f"chat template cannot render an assistant reply: {e}") from e
    if not isinstance(full, str) or _REPLY_SENTINEL not in full:
        raise TargetError("chat template does not render the assistant reply's content")
    suffix = full.split(_REPLY_SENTINEL, 1)[1]
    ids = tokenizer(suffix, add_special_tokens=False)["input_ids"] if suffix else []
    if not ids and tokenizer.eos_token_id is not None:
        # A template that writes nothing after the reply relies on the eos the model emits.
        ids = [int(tokenizer.eos_token_id)]
    return [int(i) for i in ids]


def turn_completion(output_ids: list[int], terminator: list[int]) -> list[int]:
    """The part of `terminator` the output does not already end with (its longest overlap)."""
    for k in range(min(len(terminator), len(output_ids)), 0, -1):
        if output_ids[-k:] == terminator[:k]:
            return terminator[k:]
    return list(terminator)


def eval_prompt_ids(
    prompts_by_domain: dict[str, list[str]],
    fraction: float,
    seed: int,
    conversations: dict[str, str] | None = None,
) -> set[str]:
    """Per domain, the round(fraction·n) prompts ranked first by a seeded hash (at least one
    when fraction > 0 and the domain has two or more prompts).

    With `conversations` (prompt_id -> its conversation's id, conversation_ids) each domain's
    prompts are ranked by their conversation's hash first, and each one taken brings its whole
    conversation, every domain's prompts of it, until the domain holds its count (a
    conversation may take it past). Where every conversation is one prompt (its id its own),
    that is the same split as without."""
    chosen: set[str] = set()
    if fraction <= 0:
        return chosen
    members: dict[str, set[str]] = defaultdict(set)
    for prompt, conversation in (conversations or {}).items():
        members[conversation].add(prompt)

    def rank(domain: str, key: str) -> str:
        return hashlib.sha256(f"{seed}:{domain}:{key}".encode()).hexdigest()

    for domain in sorted(prompts_by_domain):
        ids = sorted(set(prompts_by_domain[domain]))
        k = round(fraction * len(ids))
        if k == 0 and len(ids) >= 2:
            k = 1
        if conversations is None:
            chosen.update(sorted(ids, key=lambda p: rank(domain, p))[:k])
            continue
        here = set(ids)
        held = len(here & chosen)  # taken with an earlier domain's conversations
        for prompt in sorted(ids, key=lambda p: (rank(domain, conversations.get(p, p)), rank(domain, p))):
            if held >= k:
                break
            if prompt in chosen:
                continue
            taken = (members.get(conversations.get(prompt, prompt)) or {prompt}) - chosen
            chosen |= taken
            held += len(taken & here)
    return chosen


def conversation_ids(messages: dict[str, str]) -> dict[str, str]:
    """prompt_id -> the id of its conversation, for a manifest's prompts (their messages as
    JSON). A conversation is the prompts that share an opening (every turn through the first
    user turn): those a prompt per user turn makes of one conversation, and conversations that
    open alike (a held-out one keeps the others out of training too). Its id is that of its one
    prompt when it has one (a run of one prompt a conversation, whichever turn it ends at, gets
    the same split by conversation as by prompt), else of its first turn (prompt_id_of the
    opening)."""
    opening: dict[str, str] = {}  # prompt_id -> its opening's id (held as a hash, not its text)
    for prompt_id, text in messages.items():
        turns = json.loads(text)
        first_user = next((i for i, t in enumerate(turns) if t.get("role") == "user"), len(turns) - 1)
        opening[prompt_id] = prompt_id_of(turns[: first_user + 1])
    sizes = Counter(opening.values())
    return {p: p if sizes[o] == 1 else o for p, o in opening.items()}


def manifest_eval_ids(
    domains: dict[str, str], fraction: float, seed: int, conversations: dict[str, str] | None = None
) -> set[str]:
    """The held-out prompts of a manifest (prompt_id -> domain): eval_prompt_ids per domain,
    by conversation when `conversations` is given (conversation_ids)."""
    by_domain: dict[str, list[str]] = defaultdict(list)
    for pid, domain in domains.items():
        by_domain[domain].append(pid)
    return eval_prompt_ids(by_domain, fraction, seed, conversations)


def holdout_changed(recorded: str | None, builder: SequenceBuilder, where: str) -> str | None:
    """Why the held-out split `builder` makes is not the one `recorded` (a holdout_digest) by
    `where`, or None when it is. A record from before the key (None) was made per prompt: the
    split holds when the prompt unit gives the same one (a run of first-turn prompts)."""
    if recorded is None:
        if builder.holdout_unit == "prompt" or builder.holdout == builder.prompt_unit_holdout:
            return None
        return (f"{where} was made with the held-out split of before extract.holdout_unit (each prompt alone), "
                f"and this run's prompts give another by conversation: set extract.holdout_unit to 'prompt' "
                "to go on with it")  # fmt: skip
    if recorded == builder.holdout:
        return None
    return (f"{where} was made with another held-out split ({recorded}) than this run's "
            f"({builder.holdout}: extract.holdout_unit {builder.holdout_unit!r}, eval_fraction, seed or the "
            "prompts changed): go on with the settings it was made with, or start it over")  # fmt: skip


def holdout_digest(eval_ids: set[str]) -> str:
    """The held-out split's identity: a sha256 prefix of its sorted prompt ids. A stage that
    reads a run's split again (a resumed trainer, the gate's replay, an extraction resumed)
    compares it with the one recorded, so that a split changed in between is refused."""
    return hashlib.sha256("\n".join(sorted(eval_ids)).encode()).hexdigest()[:16]


HOLDOUT_UNITS = ("prompt", "conversation")


class SequenceBuilder:
    """Builds the training sequences of generation shards for one run."""

    def __init__(
        self,
        run: RunFolder,
        tokenizer: Any,
        max_length: int,
        vocab_size: int,
        eval_fraction: float = 0.0,
        seed: int = 0,
        holdout_unit: str = "conversation",
    ) -> None:
        check_chat_template(run, tokenizer)
        manifest = read_prompts_table(run, "manifest")
        pids = manifest.column("prompt_id").to_pylist()
        self._messages = dict(zip(pids, manifest.column("messages").to_pylist(), strict=True))
        self._domains = dict(zip(pids, manifest.column("domain").to_pylist(), strict=True))
        if holdout_unit not in HOLDOUT_UNITS:
            raise ValueError(f"extract.holdout_unit {holdout_unit!r}: expected one of {HOLDOUT_UNITS}")
        conversations = conversation_ids(self._messages) if holdout_unit == "conversation" else None
        self.eval_ids = manifest_eval_ids(self._domains, eval_fraction, seed, conversations)
        self.holdout_unit = holdout_unit
        self.holdout = holdout_digest(self.eval_ids)
        self._split = (eval_fraction, seed)
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.vocab_size = vocab_size
        self.terminator = terminator_ids(tokenizer)
        self._rendered: dict[str, list[int]] = {}
        # Shard tasks may share one builder; tokenizers are not guaranteed thread-safe.
        self._lock = threading.Lock()

    @functools.cached_property
    def prompt_unit_holdout(self) -> str:
        """The holdout_digest of the split each prompt alone would make (holdout_unit prompt);
        computed once, though a stage asks it of every marker."""
        return holdout_digest(manifest_eval_ids(self._domains, *self._split))

    def _render_all(self, prompt_ids: list[str]) -> None:
        """The prompts of a shard's rows rendered at once (render_many_prompt_ids); one that
        cannot be is left to _prompt_ids, which raises its error for its row alone."""
        with self._lock:
            todo = list(dict.fromkeys(p for p in prompt_ids if p in self._messages and p not in self._rendered))
            rendered = render_many_prompt_ids(self.tokenizer, [json.loads(self._messages[p]) for p in todo])
            for prompt_id, ids in zip(todo, rendered, strict=True):
                if not isinstance(ids, TargetError):
                    self._rendered[prompt_id] = ids

    def _prompt_ids(self, prompt_id: str) -> list[int]:
        with self._lock:
            if prompt_id not in self._rendered:
                self._rendered[prompt_id] = render_prompt_ids(
                    self.tokenizer, json.loads(self._messages[prompt_id])
                )
            return self._rendered[prompt_id]

    def build_one(self, row: dict[str, Any]) -> TrainingSequence:
        """One row's sequence; UnbuildableSequence or TargetError when it cannot be built."""
        prompt_id = row["prompt_id"]
        if prompt_id not in self._messages:
            raise UnbuildableSequence(
                "unknown_prompt", f"prompt {prompt_id} is not in the manifest"
            )
        prompt = self._prompt_ids(prompt_id)
        if row.get("prompt_tokens") is not None and row["prompt_tokens"] != len(prompt):
            raise UnbuildableSequence(
                "prompt_mismatch",
                f"the prompt renders to {len(prompt)} tokens but generation sent "
                f"{row['prompt_tokens']}",
            )
        output = [int(t) for t in row["output_ids"]]
        bad = [t for t in output if not 0 <= t < self.vocab_size]
        if bad:
            raise UnbuildableSequence(
                "invalid_token", f"output token {bad[0]} outside [0, {self.vocab_size})"
            )
        if len(prompt) >= self.max_length:
            raise UnbuildableSequence(
                "prompt_too_long",
                f"the prompt's {len(prompt)} tokens leave no response token within "
                f"max_length {self.max_length}",
            )
        response = output + turn_completion(output, self.terminator)
        ids = prompt + response
        mask = [0] * len(prompt) + [1] * len(response)
        truncated = len(ids) > self.max_length
        return TrainingSequence(
            sequence_id=row["request_id"],
            prompt_id=prompt_id,
            domain=self._domains[prompt_id],
            split="eval" if prompt_id in self.eval_ids else "train",
            input_ids=ids[: self.max_length],
            loss_mask=mask[: self.max_length],
            truncated=truncated,
        )

    def build(self, rows: pa.Table) -> ShardSequences:
        """Sequences of a shard's committed rows, in request_id order; failures as dead letters."""
        sequences: list[TrainingSequence] = []
        dead: list[dict[str, Any]] = []
        ordered = sorted(rows.to_pylist(), key=lambda r: r["request_id"])
        self._render_all([row["prompt_id"] for row in ordered])
        for row in ordered:
            try:
                sequences.append(self.build_one(row))
            except (UnbuildableSequence, TargetError) as e:
                dead.append(
                    {
                        "request_id": row["request_id"],
                        "prompt_id": row["prompt_id"],
                        "error_class": getattr(e, "error_class", "render_error"),
                        "message": str(e)[:500],
                    }
                )
        splits = Counter(s.split for s in sequences)
        stats = {
            "sequences": len(sequences),
            "dead": len(dead),
            "truncated": sum(s.truncated for s in sequences),
            "tokens": sum(len(s.input_ids) for s in sequences),
            "loss_tokens": sum(sum(s.loss_mask) for s in sequences),
            "splits": {name: splits.get(name, 0) for name in SPLITS},
            "dead_classes": dict(Counter(d["error_class"] for d in dead)),
        }
        return ShardSequences(sequences, dead, stats)
