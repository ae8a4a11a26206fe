"""The gate's lossless rule: a speculative config may be promoted only when each of its outputs
either equals the baseline's reference output, token for token, or first leaves it at a near-tie
of the target's own distribution.

Why not exact equality. A greedy verify emits only tokens the target chose, but on a bf16 target
the verify forward (several tokens per pass) and the decode forward (one) accumulate in different
orders, so where the target's top two logits are nearly equal the two paths can pick different
tokens. On the H200 (SmolLM2-135M, real weights) speculative outputs left the baseline's in 34-38
of 48 requests, at the same tokens in every launch, and SGLang's deterministic mode does not change
that (it makes each server repeat itself, not verify equal decode). An exact-output rule rejects
every speculative config on every real model. What the rule must still catch is output the user
would not have got without speculation: a token the target did not prefer (a wrong verify, a
sampling penalty applied differently under speculation, a server that changes output).

The evidence: a prefill re-score on the baseline server. After each baseline launch's timed
requests (untimed: tok/s is untouched) the gate sends, per benchmark prompt, one /generate with
`input_ids = prompt + reference output`, max_new_tokens 1, temperature 0, return_logprob,
`logprob_start_len = len(prompt) - 1` and `top_logprobs_num = K`. SGLang then returns the target's
distribution at every position of the reference given its exact prefix: `input_token_logprobs`
entry j (j >= 1) is output token j-1 with its logprob, `input_top_logprobs` entry j its top K (entry
0, the last prompt token, is null by SGLang's convention), and the one generated token's
`output_top_logprobs` the distribution after the whole reference (a stop the reference lacks). At
the first position d where a speculative output differs, the prefix is common by definition, so
the baseline's logprob for its own token and, when it is in the top K, the speculative token's come
straight from it. Why not logprobs on the timed requests: they cost time on both sides, and a
second run of the baseline does not reproduce the first (the same prompt sent twice gave the same
output 1 time in 4 on the real server: the radix-cache path), while the forced prefix pins the
exact position. The local engine gives the same evidence from transformers' logits of the target
(tasks/gate/local_benchmark.py), so the same rule runs on both.

The rule. At the first divergence d (nothing after it is compared: the trajectories no longer
share a prefix; vLLM's check_logprobs_close does the same), with a the reference's token and b the
speculative one, the divergence is a near-tie when both a and b lie within `gate.near_tie_nats` of
the baseline's best logprob at d: each could have been the argmax of a path that misplaces logits
by bf16 rounding. In the common case that is "a and b are the baseline's top two and their gap is
within the threshold"; but on the H200 (SmolLM2, BENCHMARKS P9) three tokens sometimes lay within 0.125
nats of each other (bf16 logits equal to the last bit), and the re-score, a third kernel path,
ranked decode's own token second or third there: a "top two" rule refused 6 of 48 requests of a
lossless config for it. Anything else is not lossless: a gap beyond the threshold, either token
further than the threshold below the best, or b outside the top K (then the gap is at least the
baseline token's logprob minus the K-th's: a lower bound, enough to refuse). When one output is a strict
prefix of the other, the shorter side's stop token (the reply's finish_reason.matched) is its token
at d. With a frequency penalty in the requests, both tokens' logprobs are penalized as SGLang's
decode penalized them at d (logit - penalty x count in the output so far; the re-score itself is
unpenalized), so the gap is the one greedy decoding compared.

The threshold (gate.near_tie_nats, default 0.625 nats), measured rather than derived. A logprob
gap between two tokens is their logit difference (the softmax normaliser is common). A flip
between decode and verify means the verify path moved the gap across zero. So the gap the
prefill re-score sees is at most how far verify can move a gap from prefill: the sum of the two
tokens' moves. BENCHMARKS P13 measured the verify path against the same server's prefill
on SmolLM2 at 4,291 positions. A token's logprob moved by up to 0.312 nats, so a gap moves by up
to ~0.62, and 0.625 (five bf16 ulps of logits of magnitude 16-32) covers it.

Why not the bound first derived here. It gave 0.5: each of the decode, verify and re-score paths
misplaces each logit by one ulp, as SGLang's own decode-against-prefill test tolerates. It left
out the KV cache, which verify wrote and decode did not, and whose rounding reaches every later
position. BENCHMARKS P12 found that out. One draft's outputs left the baseline's on one prompt, in
both launches, 117 tokens in, at a gap of 0.5625, and 0.5 refused it. Every other first divergence
measured there and in P9 lay within 0.25.

What the threshold must still catch. A frequency penalty, which SGLang applies relaxed under
speculation, changed outputs at gaps of 0.75, 0.75, 1.0 and 2.0 (P9), all beyond 0.625. Logits of
a larger magnitude have a larger ulp, so measure each new target with `node start --plan
verify-probe` (gpunode/README.md) and set the threshold from its largest move. The
baseline-vs-baseline pair the gate launches cannot show this spread (two decode launches agree
bit for bit). The gate's verify view (verify_view, gate.verify_logprobs) records it at every
refused divergence. A refusal names its gap, so a reader can tell 0.7 from 2.0.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from tasks.engines.sglang_wire import ReplyLogprobs, TokenLogprob
from tasks.gate.plan import BenchConfig, is_filler
from tasks.gate.prompts import BenchPrompt
from tasks.gate.records import RequestRecord

NEAR_TIE, NOT_LOSSLESS, NO_EVIDENCE = "near_tie", "not_lossless", "no_evidence"


class EvidenceError(ValueError):
    """A re-score answer that does not cover the reference it was asked about."""


@dataclass(frozen=True)
class PositionView:
    """The baseline's distribution at one output position, given the reference before it."""

    token: int | None  # the reference's token here (None after its last token)
    logprob: float | None  # that token's logprob
    top: tuple[tuple[int, float], ...]  # the top K (token, logprob), best first


@dataclass(frozen=True)
class ReferenceEvidence:
    """Positions 0..len(reference) of one prompt's reference output: the last one is the
    distribution after the whole reference."""

    positions: tuple[PositionView, ...]
    k: int

    def argmax_flips(self) -> int:
        """Positions whose reference token (a decode's argmax) is not the re-score's top token:
        the decode and prefill paths split a near-tie there."""
        return sum(1 for p in self.positions if p.token is not None and p.top and p.top[0][0] != p.token)


def rescore_body(prompt_ids: list[int], reference: list[int], k: int, rid: str) -> dict[str, Any]:
    """The /generate body that re-scores `reference` after `prompt_ids` on the baseline server."""
    return {
        "input_ids": [*prompt_ids, *reference],
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 1},
        "return_logprob": True,
        "logprob_start_len": len(prompt_ids) - 1,
        "top_logprobs_num": k,
        "rid": rid,
    }


def evidence_from_sglang(logprobs: ReplyLogprobs | None, prompt_ids: list[int], reference: list[int], k: int) -> ReferenceEvidence:
    """The evidence in an answer to rescore_body; EvidenceError when it does not cover the
    reference position by position (which SGLang's own assertions guarantee it does)."""
    if logprobs is None:
        raise EvidenceError("the re-score answer has no logprobs (return_logprob ignored?)")
    n, want = len(reference), [prompt_ids[-1], *reference]
    if len(logprobs.input_token) != n + 1:
        raise EvidenceError(f"input_token_logprobs has {len(logprobs.input_token)} entries for a prompt's last token "
                            f"and {n} reference tokens (logprob_start_len not honoured?)")  # fmt: skip
    got = [e.token_id for e in logprobs.input_token]
    if got != want:
        j = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
        raise EvidenceError(f"input_token_logprobs[{j}] is token {got[j]}, the input has {want[j]} there")
    if len(logprobs.input_top) != n + 1 or len(logprobs.output_top) != 1:
        raise EvidenceError(f"top logprobs for {len(logprobs.input_top)} input and {len(logprobs.output_top)} output "
                            f"positions, want {n + 1} and 1 (top_logprobs_num not honoured?)")  # fmt: skip
    views = []
    for j in range(1, n + 2):
        top = logprobs.input_top[j] if j <= n else logprobs.output_top[0]
        if not top:
            raise EvidenceError(f"no top logprobs at output position {j - 1}")
        entry = logprobs.input_token[j] if j <= n else None
        views.append(PositionView(entry.token_id if entry else None, entry.logprob if entry else None,
                                  tuple((e.token_id, float(e.logprob or 0.0)) for e in top)))  # fmt: skip
    return ReferenceEvidence(tuple(views), k)


def agreement(reference: list[int], ids: list[int]) -> tuple[bool, int | None]:
    """(exact, index of the first differing token or None)."""
    for i, (a, b) in enumerate(zip(reference, ids, strict=False)):
        if a != b:
            return False, i
    if len(reference) != len(ids):
        return False, min(len(reference), len(ids))
    return True, None


@dataclass
class Divergence:
    """Where an output first leaves the reference, and what the baseline thought of it there.
    Logprobs are the ones the gap is taken from: penalized as decode penalized them when the
    requests carried a frequency penalty (`penalty`); `top` is the re-score's, as returned."""

    position: int
    baseline_token: int | None
    speculative_token: int | None
    cls: str  # NEAR_TIE | NOT_LOSSLESS | NO_EVIDENCE
    why: str
    baseline_logprob: float | None = None
    speculative_logprob: float | None = None
    speculative_below: float | None = None  # not in the top K: its logprob is below this
    gap: float | None = None  # nats; a lower bound when speculative_below is set
    best_logprob: float | None = None  # the best (penalized) logprob at the position: both must be within the threshold of it
    top: list[list[float]] = field(default_factory=list)  # [[token, logprob], ...]
    prefix: str = ""  # "speculative stopped" | "reference stopped": one output is a prefix of the other
    penalty: float = 0.0
    threshold: float = 0.0  # gate.near_tie_nats it was judged by

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _value(view: PositionView, token: int) -> float | None:
    if token == view.token and view.logprob is not None:
        return view.logprob
    return next((lp for t, lp in view.top if t == token), None)


def classify(
    reference: list[int], ids: list[int], reference_stop: int | None, stop: int | None,
    evidence: ReferenceEvidence | str | None, threshold: float, penalty: float = 0.0,
) -> Divergence | None:  # fmt: skip
    """The first divergence of `ids` from `reference`, classified; None when they are equal.
    `*_stop`: the token each side's stop matched (None when it did not stop on a token);
    `evidence`: the reference's re-score, or why there is none."""
    exact, d = agreement(reference, ids)
    if exact or d is None:
        return None
    prefix = ""
    if d < min(len(reference), len(ids)):
        a, b = reference[d], ids[d]
    elif len(ids) < len(reference):
        a, b, prefix = reference[d], stop, "speculative stopped"
    else:
        a, b, prefix = reference_stop, ids[d], "reference stopped"
    div = Divergence(d, a, b, NOT_LOSSLESS, "", prefix=prefix, penalty=penalty, threshold=threshold)
    if a is None or b is None:
        div.why = f"one output is a strict prefix of the other and the shorter one ({prefix.split()[0]}) ended without a stop token"
        return div
    if not isinstance(evidence, ReferenceEvidence):
        div.cls, div.why = NO_EVIDENCE, f"no evidence: {evidence or 'the reference was not re-scored'}"
        return div
    if d >= len(evidence.positions):
        div.cls, div.why = NO_EVIDENCE, f"no evidence: the re-score covers {len(evidence.positions)} positions"
        return div
    view = evidence.positions[d]
    counts = Counter(reference[:d])  # the common prefix: what decode had emitted before d

    def penalized(token: int, lp: float) -> float:
        return lp - penalty * counts[token]

    div.top = [[t, lp] for t, lp in view.top]
    ranked = sorted(((penalized(t, lp), t) for t, lp in view.top), reverse=True)
    kth = min(lp for _, lp in view.top)
    la, lb = _value(view, a), _value(view, b)
    if la is None:
        div.speculative_logprob = None if lb is None else penalized(b, lb)
        div.why = f"the baseline's own token is not in its top {evidence.k} there"
        return div
    div.baseline_logprob = penalized(a, la)
    if lb is None:
        div.speculative_below = kth - penalty * counts[b]
        div.gap = div.baseline_logprob - div.speculative_below
        div.why = f"the speculative token is not in the baseline's top {evidence.k}"
        return div
    div.speculative_logprob = penalized(b, lb)
    div.gap = abs(div.baseline_logprob - div.speculative_logprob)
    # The best logprob there. Unpenalized, the top K's first; with a penalty a token outside the top
    # K (unpenalized below the K-th) may beat every penalized one of them: the K-th bounds it.
    div.best_logprob = max(ranked[0][0], kth) if penalty else ranked[0][0]
    below = {x: div.best_logprob - lp for x, lp in ((a, div.baseline_logprob), (b, div.speculative_logprob))}
    ranks = [next((i + 1 for i, (_, t) in enumerate(ranked) if t == x), None) for x in (a, b)]
    if div.gap > threshold:
        div.why = f"gap {div.gap:.3f} nats > {threshold:g}"
    elif max(below.values()) > threshold:
        x = a if below[a] > threshold else b
        who = "the baseline's own token" if x == a else "the speculative token"
        div.why = (f"{who} is {below[x]:.3f} nats below the best there (logprob {div.best_logprob:.3f}) > {threshold:g} "
                   f"(ranks {ranks[0]} and {ranks[1]})")  # fmt: skip
    else:
        rank = "" if sorted(r or 0 for r in ranks) == [1, 2] else f", ranks {ranks[0]} and {ranks[1]} of tokens within it"
        div.cls, div.why = NEAR_TIE, f"near-tie: both within {threshold:g} nats of the best, gap {div.gap:.3f}{rank}"
    return div


def path_deltas(tokens: list[TokenLogprob], evidence: ReferenceEvidence, n: int | None = None) -> list[float]:
    """|logprob - re-score logprob| of the same token at output positions 0..n-1 (all of
    `tokens` by default): how far the path that generated them (decode, or a speculative
    server's verify) is from the prefill re-score, position by position."""
    return [abs(float(t.logprob) - float(p.logprob)) for t, p in zip(tokens[:n], evidence.positions, strict=False)
            if t.logprob is not None and p.logprob is not None]  # fmt: skip


def verify_body(prompt_ids: list[int], sampling: dict[str, Any], k: int, rid: str) -> dict[str, Any]:
    """A benchmark request sent again, untimed, asking for the logprobs of what it generates: on
    a speculative server those of the tokens its verify forward accepted (verify_view)."""
    return {"input_ids": list(prompt_ids), "sampling_params": dict(sampling), "return_logprob": True,
            "logprob_start_len": len(prompt_ids) - 1, "top_logprobs_num": k, "rid": rid}  # fmt: skip


def verify_view(div: dict[str, Any], reference: list[int], evidence: ReferenceEvidence, ids: list[int],
                logprobs: ReplyLogprobs | None) -> dict[str, Any]:  # fmt: skip
    """The speculative server's own view of a divergence `div` from `reference`, from the answer
    (`ids`, `logprobs`) to its request sent again with verify_body, beside the baseline's
    re-score (`evidence`). How far the two paths disagree on the reference's token a against
    the speculative token b at the divergence (`disagreement`: the re-score's a-over-b gap plus
    the speculative path's own b-over-a gap), set against how far they disagree on the tokens
    both emitted before it (`prefix_drift_max`, `prefix_drift_mean`: |logprob difference| of the
    same token over the common prefix). A flip by numerics puts b first on the speculative path
    (`own_gap` >= 0) and disagrees by about what the prefix drifts; a change of output (a wrong
    verify, a penalty applied differently) emits b where its own forward put a first (`own_gap`
    < 0), or disagrees by far more than the drift. Recorded beside the rule's verdict, never deciding it (BENCHMARKS P12: the bound the rule's
    threshold rests on was exceeded once). `reproduced` false: the answer left the timed output
    before the divergence or at it (`left_at`), and nothing else is compared."""
    d, a, b = div["position"], div.get("baseline_token"), div.get("speculative_token")
    if div.get("prefix") or a is None or b is None:
        return {"skipped": "one output is a prefix of the other"}
    timed = [*reference[:d], b]
    exact, left = agreement(timed, ids[: d + 1])
    if not exact:
        return {"reproduced": False, "left_at": left}
    if logprobs is None or len(logprobs.output_token) < d + 1 or len(logprobs.output_top) < d + 1:
        raise EvidenceError("the answer's output logprobs do not cover the divergence (return_logprob ignored?)")
    own = logprobs.output_top[d]
    if not own:
        raise EvidenceError(f"no output top logprobs at position {d}")
    drift = path_deltas(logprobs.output_token, evidence, d)
    view: dict[str, Any] = {"reproduced": True, "positions": len(drift),
                            "prefix_drift_max": max(drift, default=0.0),
                            "prefix_drift_mean": sum(drift) / len(drift) if drift else 0.0}  # fmt: skip
    mine = {e.token_id: float(e.logprob or 0.0) for e in own}
    lb = float(logprobs.output_token[d].logprob or 0.0)
    la = mine.get(a)
    kth = min(mine.values())
    view["own_top"] = [[e.token_id, float(e.logprob or 0.0)] for e in own]
    # Not in its top K: a lies below the K-th there, so its gap and the disagreement are lower bounds.
    view["own_gap"], view["own_gap_is_bound"] = (lb - la, False) if la is not None else (lb - kth, True)
    at = evidence.positions[d] if d < len(evidence.positions) else None
    ra, rb = (_value(at, a), _value(at, b)) if at is not None else (None, None)
    if at is not None and ra is not None:
        # b outside the re-score's top K lies below its K-th: a lower bound again.
        kth_rescore = min(lp for _, lp in at.top)
        view["rescore_gap"] = ra - (rb if rb is not None else kth_rescore)
        view["disagreement"] = view["rescore_gap"] + view["own_gap"]
        view["disagreement_is_bound"] = view["own_gap_is_bound"] or rb is None
    return view


def refusal(rec: RequestRecord) -> str:
    """The sentence that fails a config for one not-lossless (or unevidenced) request."""
    d = rec.divergence or {}
    threshold = d.get("threshold", 0.0)
    where = f"request {rec.prompt_index} (prompt {rec.prompt_id}, repetition {rec.repetition}), position {d.get('position')}"
    if not d:
        return f"not lossless: {where[: where.rindex(',')]}: output leaves the baseline's at token {rec.first_mismatch}, unclassified"
    a, b = d.get("baseline_token"), d.get("speculative_token")
    if d.get("cls") == NO_EVIDENCE or d.get("baseline_logprob") is None:
        return f"not lossless: {where}: baseline token {a} vs speculative {b}: {d.get('why')}"
    base = f"baseline token {a} (logprob {d['baseline_logprob']:.3f})"
    if d.get("speculative_below") is not None:
        spec = f"speculative {b} (logprob < {d['speculative_below']:.3f}, not in the top {len(d.get('top') or [])})"
        gap = f"gap at least {d['gap']:.3f} nats > {threshold:g}" if d["gap"] > threshold else f"gap at least {d['gap']:.3f} nats"
    else:
        spec = f"speculative {b} (logprob {d['speculative_logprob']:.3f})"
        gap = f"gap {d['gap']:.3f} nats > {threshold:g}" if d["gap"] > threshold else f"gap {d['gap']:.3f} nats: {d['why']}"
    penalty = f" (frequency penalty {d['penalty']:g} applied)" if d.get("penalty") else ""
    return f"not lossless: {where}: {base} vs {spec}, {gap}{penalty}"


@dataclass
class LosslessTally:
    """A config's requests compared with the reference: exact, first diverging at a near-tie,
    not lossless, or diverging where the reference has no re-score."""

    exact: int = 0
    near_tie: int = 0
    not_lossless: int = 0
    no_evidence: int = 0
    refusals: list[str] = field(default_factory=list)  # one sentence per failing request

    @property
    def compared(self) -> int:
        return self.exact + self.near_tie + self.not_lossless + self.no_evidence

    @classmethod
    def of(cls, records: list[RequestRecord]) -> LosslessTally:
        tally = cls()
        for r in records:
            if r.error is not None or r.exact_match is None or r.reference:
                continue
            cls_ = (r.divergence or {}).get("cls")
            if r.exact_match:
                tally.exact += 1
            elif cls_ == NEAR_TIE:
                tally.near_tie += 1
            else:
                tally.no_evidence += cls_ == NO_EVIDENCE
                tally.not_lossless += cls_ != NO_EVIDENCE
                tally.refusals.append(refusal(r))
        return tally

    def rates(self) -> str:
        n = self.compared
        if not n:
            return "-"
        parts = [f"{self.exact}/{n} exact", f"{self.near_tie} near-tie", f"{self.not_lossless} not lossless"]
        return ", ".join(parts + ([f"{self.no_evidence} without evidence"] if self.no_evidence else []))


class ReferenceOutputs:
    """The baseline's output per environment and prompt (its first measured repetition), which
    every later request of that environment is compared with, and the re-score of each (the
    evidence at any divergence). `threshold`, `penalty`: gate.near_tie_nats and the requests'
    frequency penalty."""

    def __init__(self, threshold: float, penalty: float = 0.0) -> None:
        self.threshold, self.penalty = threshold, penalty
        self._ids: dict[str, dict[int, tuple[list[int], int | None]]] = {}
        self._evidence: dict[str, dict[int, ReferenceEvidence | str]] = {}

    def reference(self, env_name: str, prompt_index: int) -> list[int] | None:
        entry = self._ids.get(env_name, {}).get(prompt_index)
        return entry[0] if entry else None

    def has_evidence(self, env_name: str) -> bool:
        return bool(self._evidence.get(env_name))

    def add_evidence(self, env_name: str, prompt_index: int, evidence: ReferenceEvidence | str) -> None:
        """The re-score of a prompt's reference, or why there is none; the first one is kept."""
        self._evidence.setdefault(env_name, {}).setdefault(prompt_index, evidence)

    def evidence(self, env_name: str, prompt_index: int) -> ReferenceEvidence | str | None:
        return self._evidence.get(env_name, {}).get(prompt_index)

    def compare(self, rec: RequestRecord, config: BenchConfig, prompt: BenchPrompt, ids: list[int],
                stop: int | None = None) -> None:  # fmt: skip
        """Set rec's agreement with the reference and, where it diverges, the classified first
        divergence. `stop`: the token this output's stop matched."""
        if rec.repetition < 0 or is_filler(config):  # warm-up; simulated acceptance: filler output
            return
        ref = self._ids.setdefault(config.env_name, {})
        if config.is_baseline and prompt.index not in ref:
            ref[prompt.index] = (ids, stop)
            rec.reference = True
        if prompt.index not in ref:
            return
        reference, reference_stop = ref[prompt.index]
        rec.exact_match, rec.first_mismatch = agreement(reference, ids)
        if not rec.exact_match:
            div = classify(reference, ids, reference_stop, stop, self.evidence(config.env_name, prompt.index),
                           self.threshold, self.penalty)  # fmt: skip
            rec.divergence = div.to_dict() if div else None


def rescore_summary(evidence: list[ReferenceEvidence | str], first: list[ReferenceEvidence | str | None]) -> dict[str, Any]:
    """What a launch's re-scores showed: prompts and positions covered, failures, positions where
    the re-score's top token is not the reference's (decode and prefill split a near-tie), and
    the largest difference of the reference tokens' logprobs from the first launch's re-score
    (how far the same path moves between launches)."""
    ok = [e for e in evidence if isinstance(e, ReferenceEvidence)]
    deltas = [abs((p.logprob or 0.0) - (q.logprob or 0.0))
              for e, f in zip(evidence, first, strict=True)
              if isinstance(e, ReferenceEvidence) and isinstance(f, ReferenceEvidence) and e is not f
              for p, q in zip(e.positions, f.positions, strict=False) if p.logprob is not None and q.logprob is not None]  # fmt: skip
    return {
        "prompts": len(ok),
        "positions": sum(len(e.positions) for e in ok),
        "argmax_flips": sum(e.argmax_flips() for e in ok),
        "errors": [e for e in evidence if isinstance(e, str)],
        "max_abs_delta_vs_first": max(deltas) if deltas else None,
    }
