"""The serving policy a draft ships with: where it speculates, at which num_steps, and the server
settings that go with it (docs/GATE.md, "The gate at load").

Built from the sweep's figures per concurrency level (tasks/gate/load.py):

- **adaptive** (several levels, chains): at each level the candidate's topk=1 config that beats
  the baseline there by the most beyond the spread, else its fastest one that is not slower beyond
  the spread (never 0 steps: build_policy says why); written as SGLang's
  `--speculative-adaptive-config` tiers (tasks/sglang/adaptive.py), one candidate per tier so the
  server never moves by its EMA, with `--max-running-requests` at the highest level (0.5.14 caps a
  speculative server at 48), and as vLLM's `num_speculative_tokens_per_batch_size` schedule. It is
  verified on the server: one more launch pair (a baseline and the draft under the policy)
  measured at every level.
- **router** (topk > 1, which SGLang's adaptive mode refuses; a level where every chain is slower
  beyond the spread; or a chain whose single-server policy did not hold): speculative servers up
  to the concurrency X to which the config wins at every level, plain servers above, split by load
  at the router; its figures are the sweep's.
- **static** (one level measured): the config itself.

It holds when it is faster beyond the spread wherever the sweep's config it runs was, never slower
beyond the spread at any level, and speculates at gate.deploy_concurrency with the speedup there at
least gate.min_speedup. A gate promotes only a draft whose policy holds.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tasks.config.gate_section import GateConfig
from tasks.gate.decision import ConfigSummary, GateDecision
from tasks.gate.plan import DEFAULT_ENV, POLICY, POLICY_BASELINE, POLICY_CONFIG, BenchConfig
from tasks.runfolder import RunFolder
from tasks.sglang.adaptive import (
    ADAPTIVE_CONFIG_FLAG,
    ADAPTIVE_FLAG,
    AdaptiveConfig,
    tiers_from_levels,
    vllm_schedule,
)
from tasks.sglang.command import resolve_spec
from tasks.sglang.simulated_acceptance import SIMULATE_ACC_LEN

ADAPTIVE, ROUTER, STATIC = "adaptive", "router", "static"
POLICY_FILE = "gate/serving-policy.json"
ADAPTIVE_FILE = "gate/sglang-adaptive.json"


@dataclass
class LevelChoice:
    """What the policy runs at one level, and the sweep's figures for it."""

    level: int
    num_steps: int  # 0: no speculation at this level
    config: str | None = None  # the sweep's config it runs there
    speedup: float | None = None  # that config's over the baseline at this level (the sweep's)
    ci: list[float] | None = None
    wins: bool = False  # it beat the baseline there beyond the spread (else: it was not slower)


@dataclass
class ServingPolicy:
    kind: str  # ADAPTIVE | ROUTER | STATIC
    levels: list[LevelChoice]
    num_steps: int | None = None  # --speculative-num-steps (adaptive: the one it starts at)
    topk: int = 1
    num_draft_tokens: int | None = None
    adaptive_config: dict[str, Any] | None = None  # SGLang's --speculative-adaptive-config JSON
    max_running_requests: int | None = None
    on_up_to: int | None = None  # router: speculative servers up to this concurrency, plain above
    config: str | None = None  # router and static: the sweep config it serves
    vllm: dict[str, Any] | None = None  # vLLM's speculative_config keys for the same policy
    # Its own launch pair, per level (adaptive): speedup, CI, the sweep's figure it predicted and
    # the difference (what switching costs the server: graph swaps, EMA lag).
    verified: dict[str, dict[str, Any]] | None = None
    holds: bool | None = None  # None: not judged (the gate rejects at the deploy level)
    reasons: list[str] = field(default_factory=list)
    alternatives: list[dict[str, Any]] = field(default_factory=list)  # router policies of other configs

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def speculates_at(self, level: int) -> bool:
        return any(c.level == level and c.num_steps > 0 for c in self.levels)

    def launch_flags(self, draft: str, config_file: str = "sglang-adaptive.json") -> list[str]:
        """The speculative flags of its SGLang launch, beside the target's own."""
        if self.num_steps is None:
            return []
        tokens = self.num_draft_tokens or self.num_steps + 1
        flags = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", draft,
                 "--speculative-num-steps", str(self.num_steps), "--speculative-eagle-topk", str(self.topk),
                 "--speculative-num-draft-tokens", str(tokens)]  # fmt: skip
        if self.kind == ADAPTIVE:
            flags += [ADAPTIVE_FLAG, ADAPTIVE_CONFIG_FLAG, config_file]
        if self.max_running_requests is not None:
            flags += ["--max-running-requests", str(self.max_running_requests)]
        return flags


def _wins(s: ConfigSummary, level: int, cfg: GateConfig) -> bool:
    lv = s.levels.get(str(level))
    return lv is not None and lv.wins() and (lv.speedup or 0.0) >= cfg.min_speedup


def _choice(s: ConfigSummary | None, level: int, steps: int) -> LevelChoice:
    lv = s.levels.get(str(level)) if s else None
    if s is None or lv is None:
        return LevelChoice(level, 0)
    return LevelChoice(level, steps, s.name, lv.speedup, [lv.ci_low, lv.ci_high] if lv.ci_low is not None else None,
                       lv.wins())  # fmt: skip


def _spec_numbers(s: ConfigSummary) -> tuple[int, int, int]:
    assert s.spec is not None
    return s.spec["num_steps"], s.spec["topk"], s.spec["num_draft_tokens"]


def router_policy(s: ConfigSummary, cfg: GateConfig) -> ServingPolicy | None:
    """Speculate with `s` up to the concurrency to which it wins at every level from the lowest,
    plain servers above (None when it does not win at the lowest level)."""
    upto = None
    for level in cfg.concurrency:
        if not _wins(s, level, cfg):
            break
        upto = level
    if upto is None:
        return None
    steps, topk, tokens = _spec_numbers(s)
    levels = [_choice(s, c, steps) if c <= upto else LevelChoice(c, 0) for c in cfg.concurrency]
    return ServingPolicy(ROUTER, levels, steps, topk, tokens, on_up_to=upto, config=s.name,
                         max_running_requests=cfg.server.max_running_requests)  # fmt: skip


def _usable(s: ConfigSummary, level: int) -> bool:
    """Not slower than the baseline beyond the spread at `level` (measured there)."""
    lv = s.levels.get(str(level))
    return lv is not None and lv.speedup is not None and not lv.loses()


def _speedup_at(level: int) -> Any:
    return lambda s: s.levels[str(level)].speedup or 0.0


def build_policy(decision: GateDecision, cfg: GateConfig) -> ServingPolicy | None:
    """The policy the sweep supports (None: no config of the new draft wins at any level).

    At each level the adaptive policy runs the chain that wins there by the most, else the
    fastest chain that is at least not slower beyond the spread. It never writes a tier of 0
    steps: on SGLang 0.5.14 a speculative server's "speculation off" still runs the speculative
    pipeline, at 0.66x a plain server at concurrency 8 and 0.35x at 64 (H200, BENCHMARKS P32). A
    level where every chain is slower beyond the spread therefore needs plain servers: the
    policy is then the router split of the deploy level's best chain."""
    ours = [s for s in decision.configs if s.role == "candidate" and not s.baseline and s.eligible and s.spec]
    chains = [s for s in ours if s.is_candidate_chain()]
    routers = [p for s in ours if (p := router_policy(s, cfg)) is not None]
    winners = {c: [s for s in chains if _wins(s, c, cfg)] for c in cfg.concurrency}
    if not any(winners.values()):
        # No chain wins anywhere: a tree that wins at the lowest levels still serves behind a router.
        return max(routers, key=lambda p: (p.on_up_to or 0, p.levels[0].speedup or 0.0), default=None)
    picks = {c: max(winners[c] or [s for s in chains if _usable(s, c)], key=_speedup_at(c), default=None)
             for c in cfg.concurrency}  # fmt: skip
    if None in picks.values():
        best = decision.config(decision.best)
        policy = router_policy(best, cfg) if best is not None else None
        if policy is not None:
            lost = [c for c, s in picks.items() if s is None]
            policy.reasons.append(f"every chain is slower than the baseline beyond the spread at concurrency "
                                  f"{', '.join(map(str, lost))}: one speculative server cannot hold there")  # fmt: skip
        return policy
    steps_by_level = {c: _spec_numbers(s)[0] for c, s in picks.items() if s is not None}
    levels = [_choice(picks[c], c, steps_by_level[c]) for c in cfg.concurrency]
    if len(cfg.concurrency) == 1:
        s = picks[cfg.concurrency[0]]
        assert s is not None
        steps, topk, tokens = _spec_numbers(s)
        return ServingPolicy(STATIC, levels, steps, topk, tokens, config=s.name,
                             max_running_requests=cfg.server.max_running_requests)  # fmt: skip
    adaptive = AdaptiveConfig(tiers_from_levels(steps_by_level), {})
    cap = max(cfg.server.max_running_requests or 0, max(cfg.concurrency))
    policy = ServingPolicy(ADAPTIVE, levels, adaptive.initial_num_steps(), 1, None, adaptive.to_json(), cap)
    policy.vllm = {"num_speculative_tokens": max(steps_by_level.values()),
                   "num_speculative_tokens_per_batch_size": vllm_schedule(steps_by_level, cap)}  # fmt: skip
    policy.alternatives = [p.to_dict() for p in routers]
    return policy


def policy_launches(policy: ServingPolicy, cfg: GateConfig, draft_dir: str, work_dir: Path) -> list[BenchConfig]:
    """The adaptive policy's launch pair: a baseline, then the draft under the policy, both
    admitting every request of the highest level; in the first environment of the sweep."""
    path = Path(work_dir) / "sglang-adaptive.json"
    path.write_text(json.dumps(policy.adaptive_config, indent=1) + "\n")
    assert policy.num_steps is not None
    spec, _ = resolve_spec(draft_dir, policy.num_steps, 1, None)
    env = dict(cfg.nccl_env_sweep[0])
    forced = cfg.simulated_acceptance.get(spec.label)
    if forced is not None:  # a rehearsal: the policy's server runs at the accept length its sweep config ran at
        env[SIMULATE_ACC_LEN] = f"{forced:g}"
    note = ("the serving policy: SGLang's adaptive speculation at the tiers the sweep chose",)
    return [BenchConfig(POLICY_BASELINE, None, DEFAULT_ENV, env, role=POLICY, repetitions=1),
            BenchConfig(POLICY_CONFIG, spec, DEFAULT_ENV, env, note, role=POLICY, repetitions=1,
                        simulated_accept_length=forced, adaptive_config=str(path))]  # fmt: skip


def _fmt(speedup: float | None, ci: list[float] | None) -> str:
    if speedup is None:
        return "-"
    return f"{speedup:.3f}x" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci and ci[0] is not None else "")


def judge_adaptive(policy: ServingPolicy, decision: GateDecision, cfg: GateConfig) -> None:
    """The adaptive policy's own launch against its baseline, level by level: faster beyond the
    spread where the sweep's config was, never slower beyond the spread, the deploy level at
    min_speedup; beside each level the figure the sweep predicted for it."""
    run = decision.config(POLICY_CONFIG)
    policy.verified, problems = {}, []
    if run is None or not run.eligible:
        why = "; ".join(run.reasons) if run else "not measured"
        policy.holds, policy.reasons = False, [f"the policy's own launch gave no valid measurement: {why}"]
        return
    base = decision.config(decision.baseline)
    for choice in policy.levels:
        lv = run.levels.get(str(choice.level))
        if lv is None or lv.speedup is None:
            problems.append(f"concurrency {choice.level}: not measured")
            continue
        predicted = choice.speedup if choice.num_steps > 0 else 1.0
        ci = [lv.ci_low, lv.ci_high]
        policy.verified[str(choice.level)] = {
            "num_steps": choice.num_steps, "speedup": lv.speedup, "ci": ci, "predicted_speedup": predicted,
            "vs_predicted": lv.speedup / predicted - 1 if predicted else None,
            "tok_s": lv.median_tok_s, "throughput_tok_s": lv.throughput_tok_s,
            "max_running_requests": lv.max_running_requests,
        }  # fmt: skip
        where = f"concurrency {choice.level} ({choice.num_steps} steps): {_fmt(lv.speedup, ci)}"
        if choice.wins and not lv.wins():
            problems.append(f"{where}: not faster beyond the spread where the sweep's config was")
        elif lv.loses():
            problems.append(f"{where}: slower than the baseline beyond the spread")
    deploy = run.levels.get(str(cfg.deploy_level))
    if deploy is not None and deploy.speedup is not None and deploy.speedup < cfg.min_speedup:
        problems.append(f"at the deploy concurrency {cfg.deploy_level}: {deploy.speedup:.3f}x, below min_speedup {cfg.min_speedup:g}")
    policy.holds = not problems
    shown = ", ".join(f"{k}: {_fmt(v['speedup'], v['ci'])}" for k, v in policy.verified.items())
    base_note = f" (its own baseline beside it; the sweep's reference {base.name})" if base else ""
    policy.reasons = ([f"the adaptive policy held on its own launch at every level{base_note}: {shown}"] if policy.holds
                      else [f"the adaptive policy did not hold on its own launch: {'; '.join(problems)}"])  # fmt: skip


def judge(decision: GateDecision, cfg: GateConfig, policy: ServingPolicy | None) -> ServingPolicy | None:
    """Settle the policy and the outcome: a promotion needs a policy that holds (the adaptive
    one on its own launch, else a router split of the deploy level's chain config). Returns the
    policy the draft ships with (recorded in decision.policy)."""
    if policy is None:
        if decision.promote:
            decision.outcome = "reject"
            decision.reasons.append("no serving policy: no config wins beyond the spread at any load level")
        return None
    if not decision.promote:
        policy.reasons.append("not judged: the gate rejects the draft at the deploy concurrency")
    elif policy.kind == ADAPTIVE:
        judge_adaptive(policy, decision, cfg)
        if not policy.holds:
            fallback = _router_fallback(decision, cfg)
            if fallback is not None:
                fallback.reasons = [*policy.reasons, _router_sentence(fallback, "the deployment's alternative")]
                fallback.alternatives, fallback.verified = policy.alternatives, policy.verified
                policy = fallback
    else:
        policy.holds = policy.speculates_at(cfg.deploy_level)
        policy.reasons.append(_router_sentence(policy, "serving policy") if policy.kind == ROUTER
                              else f"serving policy: {policy.config} at the one level measured")  # fmt: skip
    decision.policy = policy.to_dict()
    if decision.promote and not policy.holds:
        decision.outcome = "reject"
        decision.reasons += ["no serving policy holds at every load level", *policy.reasons]
    elif decision.promote:
        decision.reasons += policy.reasons
    return policy


def close_rehearsal(decision: GateDecision, cfg: GateConfig) -> None:
    """A rehearsal (gate.simulated_acceptance) never promotes: its outcome says what would have been."""
    if cfg.simulated_acceptance and decision.outcome in ("promote", "reject"):
        would = decision.outcome
        decision.outcome = "rehearsal"
        decision.reasons.insert(0, f"rehearsal: acceptance forced by gate.simulated_acceptance {cfg.simulated_acceptance}; "
                                   f"a draft of those accept lengths would be a {would.upper()} here; nothing is promoted")  # fmt: skip


def _router_fallback(decision: GateDecision, cfg: GateConfig) -> ServingPolicy | None:
    best = decision.config(decision.best)
    policy = router_policy(best, cfg) if best is not None else None
    if policy is not None:
        policy.holds = policy.speculates_at(cfg.deploy_level)
    return policy


def _router_sentence(policy: ServingPolicy, what: str) -> str:
    above = [c.level for c in policy.levels if c.level > (policy.on_up_to or 0)]
    plain = f", plain servers from concurrency {above[0]}" if above else ""
    return (f"{what}: speculative servers ({policy.config}) up to concurrency {policy.on_up_to}{plain}, split by load "
            "at the router (the sweep's figures: " + ", ".join(f"{c.level}: {_fmt(c.speedup, c.ci)}" for c in policy.levels
                                                           if c.num_steps) + ")")  # fmt: skip


def write_policy(run: RunFolder, decision: GateDecision) -> None:
    """gate/serving-policy.json (the decision's policy record) and, for an adaptive policy,
    gate/sglang-adaptive.json: the file `--speculative-adaptive-config` takes."""
    if decision.policy is None:
        return
    run.write_json_atomic(POLICY_FILE, decision.policy)
    if decision.policy.get("adaptive_config"):
        run.write_json_atomic(ADAPTIVE_FILE, decision.policy["adaptive_config"])


def describe(policy: dict[str, Any]) -> str:
    """A policy record in one line: where it speculates and how."""
    on = [c for c in policy["levels"] if c["num_steps"] > 0]
    off = [c["level"] for c in policy["levels"] if c["num_steps"] == 0]
    where = ", ".join(f"{c['level']}: {c['num_steps']} steps" for c in on) or "nowhere"
    verdict = {True: "holds", False: "does not hold", None: "not judged"}[policy["holds"]]
    tail = f"; off at {', '.join(map(str, off))}" if off else ""
    if policy["kind"] == ROUTER:
        tail += f"; speculative servers up to concurrency {policy['on_up_to']}, plain servers above (split at the router)"
    return f"{policy['kind']} policy ({verdict}): speculates at {where}{tail}"


def serving_policy_main(argv: list[str]) -> int:
    """`eaglescale serving-policy`: the policy a draft ships with, as launch flags and files."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="eaglescale serving-policy",
                                description="Print the serving policy of the registry's promoted draft (or of a run's "
                                "gate): SGLang's launch flags and adaptive config, and vLLM's speculative_config.")  # fmt: skip
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--registry", help="registry URL: its promoted.json's policy")
    where.add_argument("--run-root", help="run folder: its gate/serving-policy.json (promoted or not)")
    p.add_argument("--draft", help="the draft folder the flags name (default: the promoted draft's uri, or DRAFT)")
    p.add_argument("--write-config", metavar="FILE", help="write the SGLang adaptive config here (default: print it)")
    args = p.parse_args(argv)
    folder = RunFolder(args.registry or args.run_root)
    record = folder.read_json("promoted.json") if args.registry else None
    policy = (record or {}).get("evidence", {}).get("serving_policy") if args.registry else folder.read_json(POLICY_FILE)
    if not policy:
        what = f"{folder.url}/promoted.json has no serving policy" if args.registry else f"{folder.url}/{POLICY_FILE} is missing"
        print(f"eaglescale serving-policy: {what} (gates before load levels recorded none)", file=sys.stderr)
        return 2
    draft = args.draft or (record or {}).get("uri") or "DRAFT"
    config_file = args.write_config or "sglang-adaptive.json"
    print(describe(policy))
    for line in policy["reasons"]:
        print(f"  {line}")
    flags = ServingPolicy(**{**policy, "levels": [LevelChoice(**c) for c in policy["levels"]]}).launch_flags(draft, config_file)
    print("SGLang launch flags (beside the target's):\n  " + " ".join(flags) if flags else "no speculative flags")
    if policy.get("adaptive_config"):
        text = json.dumps(policy["adaptive_config"], indent=1) + "\n"
        if args.write_config:
            Path(args.write_config).write_text(text)
            print(f"adaptive config written to {args.write_config}")
        else:
            print(f"adaptive config ({config_file}):\n{text}", end="")
    if policy.get("vllm"):
        print(f"vLLM speculative_config keys: {json.dumps(policy['vllm'])}")
    return 0
