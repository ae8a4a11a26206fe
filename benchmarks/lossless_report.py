"""Issue 26's figures from a real run of `benchmarks/h200_run.py --plan lossless`: how the gate's
lossless rule judged every speculative output on a bf16 target, the baseline-vs-baseline rate
beside it, what the logprob probe saw of decode against prefill, the same gate with a frequency
penalty, and the break-even the server measured against the cost model's.

    .venv/bin/python benchmarks/lossless_report.py benchmarks/results/real-run-node/run-9

The recipe plan's gate (run 11: three drafts at num_steps 3, the run's `recipe-default` root) is
read the same way when it is there.

Each recorded divergence is also judged again by the rule as it stands (tasks/gate/lossless.py):
a record keeps the re-score's top K, both tokens' logprobs (penalized as decode penalized them)
and the threshold, which is all the rule reads when the requests carried no penalty. With a
penalty the best token's penalized logprob needs the reference's counts, which a record does not
keep: such a record is re-judged only where its own gap already exceeds the threshold. Writes
`lossless.json` beside the results and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.real_run_report import Results  # noqa: E402 - after the path set-up

GAP_EDGES = (0.0, 0.0625, 0.125, 0.25, 0.5)


def rejudge(d: dict[str, Any]) -> str:
    """The current rule's class for a recorded divergence: near_tie, not_lossless, no_evidence or
    undetermined (penalized, within the threshold: the best's penalized logprob is not recorded)."""
    if d["cls"] in ("no_evidence", "near_tie"):  # a near-tie by the top-two rule is one now: the best is one of the two
        return d["cls"]
    la, lb, t = d.get("baseline_logprob"), d.get("speculative_logprob"), d["threshold"]
    if la is None or lb is None:  # a token outside the top K
        return "not_lossless"
    if abs(la - lb) > t:
        return "not_lossless"
    if d.get("penalty"):
        return "undetermined"
    best = max(lp for _, lp in d["top"])
    return "near_tie" if best - min(la, lb) <= t else "not_lossless"


def _gap_histogram(gaps: list[float]) -> dict[str, int]:
    edges = [*GAP_EDGES, float("inf")]
    out = {}
    for lo, hi in zip(edges, edges[1:], strict=False):
        out[f"<= {hi:g}" if hi != float("inf") else f"> {lo:g}"] = sum(1 for g in gaps if (g <= hi if lo == 0 else lo < g <= hi))
    return out


def gate_figures(report: dict[str, Any]) -> dict[str, Any]:
    decision = report["decision"]
    launches = report["bench"]["launches"]
    configs: dict[str, Any] = {}
    for c in decision["configs"]:
        if not c.get("lossless", {}).get("compared"):
            continue
        divs = [q["divergence"] for x in launches if x["config"] == c["name"] for q in x["requests"]
                if q.get("divergence") and not q.get("reference")]  # fmt: skip
        again = [rejudge(d) for d in divs]
        configs[c["name"]] = {
            "as_judged": {k: c["lossless"][k] for k in ("compared", "exact", "near_tie", "not_lossless", "no_evidence")},
            "rejudged": {k: again.count(k) for k in ("near_tie", "not_lossless", "no_evidence", "undetermined")},
            "gaps": _gap_histogram([d["gap"] for d in divs if d.get("gap") is not None]),
            "first_divergence_positions": sorted(d["position"] for d in divs),
            "median_tok_s": c.get("median_tok_s"), "speedup": c.get("speedup"), "ci": [c.get("ci_low"), c.get("ci_high")],
            "accept_length": c.get("accept_length"), "eligible": c.get("eligible"), "reasons": c.get("reasons", [])[:2],
            # The speculative server's own view of a divergence (gate.verify_logprobs), where the gate recorded one.
            "verify_views": [{"position": d["position"], "gap": d.get("gap"), **d["verify"]} for d in divs if d.get("verify")],
        }  # fmt: skip
    rescore = [x["rescore"] for x in launches if x.get("rescore")]
    return {"outcome": decision["outcome"], "reasons": decision["reasons"], "configs": configs, "rescore": rescore,
            "breakeven": decision.get("breakeven")}  # fmt: skip


def collect(results: Path) -> dict[str, Any]:
    files = Results(results)
    out: dict[str, Any] = {"results": str(results)}
    for name, member in (("gate", "run/gate/report.json"), ("penalty_gate", "run-penalty/gate/report.json"),
                         ("recipe_gate", "recipe-default/gate/report.json")):  # fmt: skip
        report = files.json(member)
        if report is not None:
            out[name] = gate_figures(report)
    out["probe"] = files.json("recorded/probe.json")
    return out


def _print(fig: dict[str, Any]) -> None:
    for name in ("gate", "penalty_gate", "recipe_gate"):
        g = fig.get(name)
        if not g:
            continue
        print(f"\n{name}: {g['outcome'].upper()}: {g['reasons'][0]}")
        print("| config | compared | exact | near-tie | not lossless | re-judged now (near-tie / not / undetermined) | gaps (nats) | speedup |")
        print("|---|---|---|---|---|---|---|---|")
        for c, v in g["configs"].items():
            a, r = v["as_judged"], v["rejudged"]
            speed = f"{v['speedup']:.3f}x" if v["speedup"] is not None else "-"
            print(f"| {c} | {a['compared']} | {a['exact']} | {a['near_tie']} | {a['not_lossless']} | "
                  f"{r['near_tie']} / {r['not_lossless']} / {r['undetermined']} | {v['gaps']} | {speed} |")  # fmt: skip
        for x in g["rescore"]:
            print(f"re-score: {x}")
    be = (fig.get("gate") or {}).get("breakeven")
    if be:
        print(f"\nbreak-even (baseline decode {be['baseline_decode_tok_s']:.1f} tok/s):")
        for k, row in sorted(be["per_steps"].items(), key=lambda kv: int(kv[0])):
            pts = ", ".join(f"{p['accept_length']:.2f} -> {p['decode_tok_s']:.0f} tok/s" for p in row["points"])
            print(f"- num_steps {k}: {row['statement']} [{pts}]")
    if fig.get("probe"):
        for p in fig["probe"]["prompts"]:
            print(f"probe: {p}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="what `node wait` brought back (results.tar.gz inside)")
    args = parser.parse_args()
    results = Path(args.results)
    fig = collect(results)
    (results / "lossless.json").write_text(json.dumps(fig, indent=1, default=str))
    _print(fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
