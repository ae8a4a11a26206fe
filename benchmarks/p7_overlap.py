"""P7 with `orchestration.overlap`: a simulated full-size run, sequential vs overlapped, side by side.

One invocation makes two fresh runs of the real `data-scaling` flow (`eaglescale run`, stages
discover,generate,extract,train; the gate is not run) through one `prefect server start`, on the
same synthetic prompts, each against a fresh pool of `eaglescale serve-sglang --simulate` servers:
first with the stages one after another, then with `--set orchestration.overlap=true`;
--overlapped-first swaps the order. Sizes are P7's scaled down (--prompts in kimi-k25.yaml's shard
count, each server's slots scaled with the shard, --words-scale x P7's prompt lengths); --step-ms
sets generation's length against extraction's, which runs on one torch thread. Times are the run
folder's stage clocks (`eaglescale status --json`). What is real, simulated and scaled, and the
goal (issue 12, `summarize`): BENCHMARKS.md, "P7 with `orchestration.overlap`".

    .venv/bin/python benchmarks/p7_overlap.py --step-ms 36   # stages of similar length (~6 min)
    .venv/bin/python benchmarks/p7_overlap.py --json /tmp/p7-overlap.json   # generation 2.5x longer
    .venv/bin/python benchmarks/p7_overlap.py --prompts 600 --step-ms 40 --train-steps 5  # quick
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

import benchmarks.p7_full_size as p7  # noqa: E402
from tasks.standins.server import ServerProcess  # noqa: E402

MODES: dict[str, tuple[str, ...]] = {
    "sequential": (),
    "overlapped": ("orchestration.overlap=true",),
}
STAGES = ["discover", "generate", "extract", "train"]
# kimi-k25.yaml: 83,288 prompts in shards of 500, 128 requests per server.
KIMI_SHARDS, KIMI_SHARD_SIZE, KIMI_CONCURRENCY = 167, 500, 128
Clocks = dict[str, tuple[float, float]]  # stage -> (started_at, ended_at), UNIX seconds


def sizes(prompts: int, shards: int) -> tuple[int, int]:
    """(shard size, requests per server) for `prompts` in about `shards` shards, the server's
    slots scaled with the shard so that one shard is the same share of the pool as in kimi-k25."""
    shard_size = math.ceil(prompts / shards)
    return shard_size, max(1, round(KIMI_CONCURRENCY * shard_size / KIMI_SHARD_SIZE))


def write_params(work: Path, a: argparse.Namespace, shard_size: int, concurrency: int) -> Path:
    """kimi-k25.yaml with the tiny target, the synthetic sources, CPU extraction and training,
    and no stage deployments (every stage a subflow of the one flow run)."""
    p = p7.kimi_params(work, STAGES if a.train_steps else STAGES[:3], a.prompts, a.max_new_tokens, a.words_scale)
    p.pop("gate", None)
    p["engine"].update(endpoints=["http://127.0.0.1:9"], concurrency_per_server=concurrency)
    p["generate"]["shard_size"] = shard_size
    # The local capture on the CPU; positions capped at the tiny target's 2,048 (longer
    # sequences are cut and counted, as production's 8,192 would be).
    p["extract"] = {"engine": "local", "device": "cpu", "dtype": "float32", "batch_size": a.extract_batch,
                    "max_length": 2048, "storage_dtype": "bf16", "eval_fraction": 0.02}  # fmt: skip
    p["train"] = {"device": "cpu", "nproc": 1, "draft_vocab_size": 1024, "ttt_steps": 3, "learning_rate": 0.01,
                  "warmup_steps": 2, "max_steps": max(1, a.train_steps), "batch_tokens": 2048,
                  "eval_every": max(1, a.train_steps), "save_every": max(1, a.train_steps)}  # fmt: skip
    path = work / "params.yaml"
    path.write_text(yaml.safe_dump(p))
    return path


def stage_clocks(run_root: Path) -> Clocks:
    """The stage clocks as `eaglescale status --json` reports them."""
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", "status", str(run_root), "--json"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    stages = json.loads(out.stdout)["stages"]
    return {k: (float(c["started_at"]), float(c["ended_at"])) for k, c in stages.items() if c.get("ended_at")}


def run_mode(work: Path, name: str, a: argparse.Namespace, api_url: str, params: Path, concurrency: int,
             vocab: int, prefect_pid: int) -> dict[str, Any]:  # fmt: skip
    """One fresh run of the DAG against a fresh simulator pool: wall, stage clocks, sim stats."""
    import httpx

    sim_args = ["--simulate", "--step-latency-ms", str(a.step_ms), "--max-batch", str(concurrency),
                "--vocab-size", str(vocab)]  # fmt: skip
    root, log_path = work / name / "run", work / f"{name}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "SLACK_"))}
    env.update(PREFECT_API_URL=api_url, PREFECT_HOME=str(work / "client-home"), HF_HUB_OFFLINE="1",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", OMP_NUM_THREADS="1")  # fmt: skip
    with contextlib.ExitStack() as stack:
        sims = [stack.enter_context(ServerProcess(sim_args)) for _ in range(a.servers)]
        endpoints = "[" + ",".join(s.url for s in sims) + "]"
        sets = [f"engine.endpoints={endpoints}", *MODES[name]]
        cmd = [sys.executable, "-m", "flows.cli", "run", "--params", str(params), "--run-root", str(root),
               *[x for s in sets for x in ("--set", s)]]  # fmt: skip
        t0 = time.time()
        with log_path.open("wb") as log:
            flow = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            # The box is shared and has two cores: CPU use, ours and the rest, says whether
            # the stages competed for them (and whether both runs ran under the same load).
            cpu = CpuSampler({"flow": [flow.pid], "sims": [x.proc.pid for x in sims], "prefect": p7.descendants(prefect_pid)})
            cpu.start()
            rc = flow.wait()
        wall = time.time() - t0
        cpu.done.set()
        cpu.join()
        sim = [httpx.get(f"{s.url}/_stats", timeout=10).json()["backend"] for s in sims]
    if rc != 0:
        print(log_path.read_text(errors="replace")[-4000:], file=sys.stderr)
    n_problems, problems = p7.problem_lines(log_path)
    clocks = stage_clocks(root) if rc == 0 else {}
    return {"rc": rc, "wall": wall, "clocks": clocks, "log": str(log_path),
            "pace": extraction_pace(root, clocks) if rc == 0 else {},
            "problem_lines": n_problems, "problem_examples": problems,
            "load_mean": sum(x["load"] for x in cpu.samples) / max(1, len(cpu.samples)),
            "load_max": max((x["load"] for x in cpu.samples), default=0.0),
            "cpu_cores": cpu_in_stages(cpu.samples, clocks),
            "sim_steps": sum(s["steps"] for s in sim), "sim_tokens": sum(s["tokens"] for s in sim),
            "extract": extract_summary(root) if rc == 0 else {}}  # fmt: skip


def _cpu_s(pid: int) -> float:
    """utime + stime of a process and its waited-for children, 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (all cores, /proc/stat)."""
    first = Path("/proc/stat").read_text().split("\n", 1)[0]
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, first.split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class CpuSampler(threading.Thread):
    """Every `period` s: the load average, the machine's busy CPU seconds, and those of our
    process groups (the flow process, the simulators, the Prefect server)."""

    def __init__(self, groups: dict[str, list[int]], period: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.groups, self.period = groups, period
        self.samples: list[dict[str, float]] = []
        self.done = threading.Event()

    def sample(self) -> None:
        row = {"t": time.time(), "load": os.getloadavg()[0], "machine": _machine_busy_s()}
        row.update({name: sum(_cpu_s(pid) for pid in pids) for name, pids in self.groups.items()})
        self.samples.append(row)

    def run(self) -> None:
        self.sample()
        while not self.done.wait(self.period):
            self.sample()


def cpu_in_stages(samples: list[dict[str, float]], clocks: Clocks) -> dict[str, dict[str, float]]:
    """Cores in use during each stage (its CPU seconds over its length), per group: ours, and
    `other` = the machine's busy time minus ours (other jobs on the box)."""
    out: dict[str, dict[str, float]] = {}
    for stage, (start, end) in clocks.items():
        inside = [x for x in samples if start <= x["t"] <= end]
        if len(inside) < 2:
            continue
        a, b = inside[0], inside[-1]
        span = b["t"] - a["t"]
        cores = {k: (b[k] - a[k]) / span for k in a if k not in ("t", "load")}
        cores["other"] = cores["machine"] - sum(v for k, v in cores.items() if k != "machine")
        out[stage] = cores
    return out


def extract_summary(root: Path) -> dict[str, Any]:
    """What extraction committed: shards, sequences, tokens, truncated sequences, dead rows."""
    from tasks.runfolder import RunFolder, ShardStore

    markers = ShardStore(RunFolder(str(root)), "extract").committed().values()
    keys = ("rows", "dead", "tokens", "truncated")
    return {"shards": len(markers), **{k: sum(int(m.get(k) or 0) for m in markers) for k in keys}}


def extraction_pace(root: Path, clocks: Clocks) -> dict[str, Any]:
    """How extraction kept up: wall seconds per extract shard while generation ran and after
    it ended (from the shard markers' commit times; while extraction keeps up, the first also
    holds its waits for new markers), the shards left when generation ended, and the median
    lag of a shard's extraction commit behind its generation commit."""
    from tasks.runfolder import RunFolder, ShardStore

    run = RunFolder(str(root))
    gen = ShardStore(run, "generate").committed()
    ext = sorted((float(m["committed_at"]), sid) for sid, m in ShardStore(run, "extract").committed().items())
    g_end, (e_start, e_end) = clocks["generate"][1], clocks["extract"]
    during = [t for t, _ in ext if t <= g_end]
    after = [t for t, _ in ext if t > g_end]
    lags = sorted(t - float(gen[sid]["committed_at"]) for t, sid in ext)
    return {"shards_during_generation": len(during), "shards_after_generation": len(after),
            "s_per_shard_during": (min(g_end, e_end) - e_start) / len(during) if during else None,
            "s_per_shard_after": (e_end - max(g_end, e_start)) / len(after) if after else None,
            "median_lag_s": lags[len(lags) // 2] if lags else None}  # fmt: skip


def summarize(clocks: dict[str, Clocks]) -> dict[str, Any]:
    """The goal's arithmetic on the two runs' stage clocks (UNIX seconds).

    span: first stage start to last stage end; window: generate and extract together;
    bound: discover + the longer of generate and extract in the sequential run + train, the
    latter two as they ran in the overlapped run (what cannot overlap: training's length is
    its own, whichever mode ran it); goal: overlapped span <= 1.15 x bound."""
    seq, ovl = clocks["sequential"], clocks["overlapped"]

    def length(c: Clocks, stage: str) -> float:
        return c[stage][1] - c[stage][0] if stage in c else 0.0

    def span(c: Clocks) -> float:
        return max(e for _, e in c.values()) - min(s for s, _ in c.values())

    def window(c: Clocks) -> float:
        return max(c["generate"][1], c["extract"][1]) - min(c["generate"][0], c["extract"][0])

    longest = max(length(seq, "generate"), length(seq, "extract"))
    cannot_overlap = length(ovl, "discover") + length(ovl, "train")
    bound = longest + cannot_overlap
    out: dict[str, Any] = {
        "lengths": {m: {s: length(c, s) for s in c} for m, c in clocks.items()},
        "sum_of_stages": {m: sum(length(c, s) for s in c) for m, c in clocks.items()},
        "span": {m: span(c) for m, c in clocks.items()},
        "generate_extract_window": {m: window(c) for m, c in clocks.items()},
        "longest_of_generate_extract": longest,
        "cannot_overlap": cannot_overlap,
        "bound": bound,
        "goal": 1.15 * bound,
        "window_goal": 1.15 * longest,
    }
    out["met"] = out["span"]["overlapped"] <= out["goal"]
    out["window_met"] = out["generate_extract_window"]["overlapped"] <= out["window_goal"]
    out["overlapped_over_bound"] = out["span"]["overlapped"] / bound
    out["overlapped_over_sequential"] = out["span"]["overlapped"] / out["span"]["sequential"]
    return out


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def report(setup: dict[str, Any], runs: dict[str, dict[str, Any]], s: dict[str, Any]) -> None:
    print(f"P7 with orchestration.overlap ({setup['cpus']} cpus): {setup['prompts']:,} prompts, "
          f"{setup['shards']} shards of {setup['shard_size']}, {setup['parallel_shards']} parallel, "
          f"{setup['servers']} sim servers x {setup['concurrency']} ({setup['step_ms']:g} ms steps), "
          f"max_new_tokens {setup['max_new_tokens']}, train {setup['train_steps']} steps")  # fmt: skip
    print(f"{'stage':<10}{'sequential':>26}{'overlapped':>26}   (start - end (length), s after discover began)")
    t0 = {m: min(st for st, _ in r["clocks"].values()) for m, r in runs.items()}
    for stage in runs["sequential"]["clocks"]:
        cells = []
        for m, r in runs.items():
            st, en = r["clocks"].get(stage, (math.nan, math.nan))
            cells.append(f"{st - t0[m]:7.1f} - {en - t0[m]:6.1f} ({en - st:6.1f})")
        print(f"{stage:<10}{cells[0]:>26}{cells[1]:>26}")
    rows = [("process wall", "wall"), ("sum of stages", "sum_of_stages"), ("stages, first start -> last end", "span"),
            ("generate start -> extract end", "generate_extract_window")]  # fmt: skip
    for label, key in rows:
        vals = {m: runs[m]["wall"] for m in runs} if key == "wall" else s[key]
        print(f"{label:<34}{vals['sequential']:>10.1f} s{vals['overlapped']:>10.1f} s")
    for m, r in runs.items():
        e = r["extract"]
        print(f"{m}: extracted {e.get('rows', 0):,} sequences ({e.get('tokens', 0):,} tokens, "
              f"{e.get('truncated', 0)} truncated, {e.get('dead', 0)} dead) in {e.get('shards', 0)} shards; "
              f"sim steps {r['sim_steps']:,}, tokens {r['sim_tokens']:,}; warning/error log lines "
              f"{r['problem_lines']}; load average mean {r['load_mean']:.2f}, max {r['load_max']:.2f}")  # fmt: skip
        p = r["pace"]
        print(f"  extract pace: {p['shards_during_generation']} shards while generation ran "
              f"({_fmt(p['s_per_shard_during'])} s of wall each), {p['shards_after_generation']} after it "
              f"({_fmt(p['s_per_shard_after'])} s of wall each); median lag behind generation's commit "
              f"{_fmt(p['median_lag_s'])} s")  # fmt: skip
        for stage, c in r["cpu_cores"].items():
            print(f"  cores busy during {stage:<9}" + ", ".join(f"{k} {v:.2f}" for k, v in c.items()))
        for line in r["problem_examples"]:
            print(f"  ! {line}")
    print(f"goal: overlapped {s['span']['overlapped']:.1f} s <= 1.15 x ({s['longest_of_generate_extract']:.1f} "
          f"longest of generate/extract + {s['cannot_overlap']:.1f} discover and train) = {s['goal']:.1f} s: "
          f"{'met' if s['met'] else 'MISSED'} ({s['overlapped_over_bound']:.3f} x the bound; "
          f"{s['overlapped_over_sequential']:.3f} x the sequential run's {s['span']['sequential']:.1f} s)")  # fmt: skip
    print(f"generate+extract window: {s['generate_extract_window']['overlapped']:.1f} s <= 1.15 x "
          f"{s['longest_of_generate_extract']:.1f} s = {s['window_goal']:.1f} s: "
          f"{'met' if s['window_met'] else 'MISSED'}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=6000, help="manifest size (discover.total_prompts)")
    ap.add_argument("--shards", type=int, default=KIMI_SHARDS, help="about this many shards (kimi-k25: 167)")
    ap.add_argument("--servers", type=int, default=4)
    ap.add_argument("--step-ms", type=float, default=90.0, help="simulated decode step: generation's length")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--words-scale", type=float, default=0.1, help="x P7's prompt word counts")
    ap.add_argument("--extract-batch", type=int, default=16, help="extract.batch_size (kimi-k25: 16)")
    ap.add_argument("--train-steps", type=int, default=20, help="0: no training stage")
    ap.add_argument("--overlapped-first", action="store_true", help="run the overlapped mode first")
    ap.add_argument("--keep", type=Path, default=None, help="work in this folder and keep it")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    a = ap.parse_args(argv)
    p7.ensure_tiny_target()
    vocab = json.loads((p7.TINY / "config.json").read_text())["vocab_size"]
    shard_size, concurrency = sizes(a.prompts, a.shards)
    setup = {"prompts": a.prompts, "shards": math.ceil(a.prompts / shard_size), "shard_size": shard_size,
             "parallel_shards": yaml.safe_load(p7.KIMI.read_text())["generate"]["max_parallel_shards"],
             "servers": a.servers, "concurrency": concurrency, "step_ms": a.step_ms,
             "max_new_tokens": a.max_new_tokens, "words_scale": a.words_scale, "train_steps": a.train_steps, "overlapped_first": a.overlapped_first, "cpus": os.cpu_count()}  # fmt: skip
    with contextlib.ExitStack() as stack:
        work = a.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="p7o-")))
        work.mkdir(parents=True, exist_ok=True)
        params = write_params(work, a, shard_size, concurrency)
        api_url, server, server_log = stack.enter_context(p7.prefect_server(work, None))
        order = list(MODES)[::-1] if a.overlapped_first else list(MODES)
        done = {m: run_mode(work, m, a, api_url, params, concurrency, vocab, server.pid) for m in order}
        runs = {m: done[m] for m in MODES}
        server_problems = p7.problem_lines(server_log)
    if any(r["rc"] != 0 for r in runs.values()):
        codes = {m: r["rc"] for m, r in runs.items()}
        print(f"a run failed: {codes}", file=sys.stderr)
        return 1
    s = summarize({m: r["clocks"] for m, r in runs.items()})
    report(setup, runs, s)
    print(f"Prefect server warning/error lines: {server_problems[0]}")
    if a.json is not None:
        a.json.write_text(json.dumps({"setup": setup, "runs": runs, "summary": s}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
