"""The SGLang benchmark protocol (docs/GATE.md): the promotion evidence.

- configs: per environment of `nccl_env_sweep` (the same env dict for the baseline and the
  speculative launches compared with it), the baseline plus num_steps at topk=1 plus the
  topk>1 points;
- every repetition of every config is a fresh launch; in each repetition the baseline and the
  speculative configs alternate in launch order (baseline first in even repetitions, last in
  odd ones, the speculative configs rotated) so slow drift does not favour one side;
- per launch: health, server-info check, warm-up requests, cost probes (per load level), then
  at each level of gate.concurrency (/flush_cache first) the fixed seeded held-out prompts at
  temperature 0, that many requests in flight at a time (one at a time at concurrency 1);
- after the policy's sweep decision, the serving policy's own launch pair (run_more:
  tasks/gate/serving_policy.py) on the same ports and references;
- per request: completion tokens, latency, tok/s, spec_verify_ct, accept length, the
  correct-drafts histogram when the server gives one, finish reason, agreement with the
  baseline's output (exact, or the first divergence classified by tasks/gate/lossless.py);
- after a baseline launch's lowest level, untimed: the prefill re-score of each prompt's
  reference output, the lossless rule's evidence (later levels are judged by it too);
- after a speculative launch's measured requests, untimed (gate.verify_logprobs): each request
  refused as not lossless (or each that diverged) sent again with return_logprob, its verify
  path's own view of the divergence recorded beside the verdict (lossless.verify_view);
- break-even launches (gate.breakeven_accept_lengths): gate.breakeven_prompts prompts, each run
  to max_new_tokens (ignore_eos: under simulated acceptance the output is filler);
- a speculative launch whose accept length after warm-up is below the floor stops the gate
  with a diagnosis (acceptance stuck at 1.0 is the EAGLE-vs-EAGLE3 symptom).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from tasks.config.gate_section import GateConfig
from tasks.engines.sglang_wire import MalformedResponse, error_message, read_generate_reply
from tasks.gate.gpu_samples import GpuSampler, window_summary
from tasks.gate.lossless import (
    NOT_LOSSLESS,
    EvidenceError,
    ReferenceEvidence,
    ReferenceOutputs,
    evidence_from_sglang,
    rescore_body,
    rescore_summary,
    verify_body,
    verify_view,
)
from tasks.gate.plan import (
    BREAKEVEN,
    CANDIDATE,
    POLICY,
    BenchConfig,
    GateStopped,
    is_filler,
    launch_order,
    level_requests,
    load_levels,
)
from tasks.gate.progress import GateProgress
from tasks.gate.prompts import BenchPrompt
from tasks.gate.records import BenchResult, LaunchRecord, RequestRecord, accept_length
from tasks.sglang.command import LaunchSpec, SpecParams
from tasks.sglang.server_process import (
    EmulatedLauncher,
    LaunchedServer,
    Launcher,
    PortPool,
    ServerStartError,
    SGLangLauncher,
    check_server_info,
    fetch_server_info,
    launch,
    parse_server_log,
    unreported_server_info,
    wait_healthy,
)
from tasks.sglang.server_settings import ServerSettings

PROBE_REPETITION = -2  # cost-probe requests: neither warm-up (-1) nor measured (>= 0)
STUCK_DIAGNOSIS = "acceptance stuck at 1.0: check --speculative-algorithm EAGLE3 and the aux hidden states"


def diagnose_acceptance(accept: float, floor: float, config: str, when: str = "after warm-up") -> str:
    if accept < 1.05:
        return f"{STUCK_DIAGNOSIS} ({config}: accept length {accept:.2f} {when})"
    return (
        f"acceptance length {accept:.2f} {when} is below the floor {floor:g} ({config}): the draft "
        f"barely predicts the target; check it was trained on this target's outputs, the aux layer ids "
        f"and the vocab map"
    )


def run_protocol(
    configs: list[BenchConfig],
    prompts: list[BenchPrompt],
    repetitions: int,
    launch: Callable[[int, BenchConfig, LaunchRecord], None],
) -> BenchResult:
    """Every (repetition, config) in launch order, one LaunchRecord each, filled by `launch`;
    the first GateStopped ends the benchmark with its diagnosis."""
    result = BenchResult(configs, prompts, repetitions)
    for rep, config in launch_order(configs, repetitions):
        record = LaunchRecord(config.name, config.env_name, rep, "", "")
        result.launches.append(record)
        try:
            launch(rep, config, record)
        except GateStopped as e:
            result.stopped = str(e)
            break
    return result


def check_acceptance(floor: float, config: BenchConfig, records: list[RequestRecord], when: str) -> float:
    """Accept length over `records`; stops the gate on failed requests, on a server that does
    not speculate, and below the floor (with the diagnosis)."""
    failed = [r.error for r in records if r.error]
    if failed:
        raise GateStopped(f"{config.name}: requests failed {when}: {failed[0]}")
    if any(r.spec_verify_ct is None for r in records):
        raise GateStopped(f"{config.name}: the server returned no spec_verify_ct: speculative decoding is not active")
    verify = sum(r.spec_verify_ct or 0 for r in records)
    accept = accept_length(sum(r.completion_tokens for r in records), verify, len(records)) or 1.0
    if accept < floor:
        raise GateStopped(diagnose_acceptance(accept, floor, config.name, when))
    return accept


@dataclass
class _Started:
    """A launch of the current wave: serving (server set), or failed to start (error set)."""

    spec: LaunchSpec
    server: LaunchedServer | None
    started_at: float
    health_s: float | None = None
    error: str | None = None
    log_path: str = ""


class GateRunner:
    """Runs the launches of `configs` in protocol order; `run()` returns everything measured.

    With `cfg.concurrent_servers` N > 1 the launches start in waves of N (in protocol order);
    every server of a wave is serving before the first is measured, and each is measured alone
    while the others wait idle, then stopped. Nothing starts or compiles during a measurement.
    """

    def __init__(
        self,
        cfg: GateConfig,
        launcher: Launcher,
        model_path: str,
        configs: list[BenchConfig],
        prompts: list[BenchPrompt],
        work_dir: Path,
        progress: GateProgress | None = None,
    ) -> None:
        if not prompts:
            raise GateStopped("no benchmark prompts")
        self.cfg, self.launcher, self.model_path = cfg, launcher, model_path
        self.progress = progress
        self.configs, self.prompts, self.work_dir = configs, prompts, Path(work_dir)
        self.reference = ReferenceOutputs(cfg.near_tie_nats, cfg.frequency_penalty)
        self._rids = itertools.count()
        self._order = launch_order(configs, cfg.repetitions)
        self._next = 0  # index into _order of the next launch run_protocol asks for
        self._started: dict[int, _Started] = {}
        self._ports = PortPool(cfg.host)  # every server of the gate: its own HTTP and NCCL ports
        if progress is not None:
            progress.planned(len(self._order))

    def run(self) -> BenchResult:
        """The launches of the configs given at construction."""
        return self._run(self.configs, self.cfg.repetitions)

    def run_more(self, configs: list[BenchConfig], result: BenchResult, repetitions: int = 1) -> BenchResult:
        """Launches decided after the first ones (the serving policy's pair), on the same ports,
        the same references of the lossless rule and the same progress: appended to `result`."""
        order = launch_order(configs, repetitions)
        self._order.extend(order)
        if self.progress is not None:
            self.progress.planned(len(self._order))
        more = self._run(configs, repetitions)
        result.configs += configs
        result.launches += more.launches
        result.stopped = result.stopped or more.stopped
        return result

    def _run(self, configs: list[BenchConfig], repetitions: int) -> BenchResult:
        # One connection per request in flight at the highest load level (httpx's pool holds 100).
        width = max(self.cfg.concurrency) + 8
        limits = httpx.Limits(max_connections=max(100, width), max_keepalive_connections=max(20, width))
        with httpx.Client(timeout=self.cfg.request_timeout_s, trust_env=False, limits=limits) as client:
            try:
                return run_protocol(
                    configs, self.prompts, repetitions,
                    lambda rep, config, record: self._launch(client, rep, config, record),
                )  # fmt: skip
            finally:  # a stopped benchmark leaves no server of its wave behind
                for started in self._started.values():
                    if started.server is not None:
                        started.server.stop()
                self._started.clear()

    def _spec(self, config: BenchConfig) -> LaunchSpec:
        return launch_spec(self.cfg, self.model_path, config, self._ports)

    def _start_wave(self, client: httpx.Client, first: int) -> None:
        """Start launches first..first+N-1 together, then wait until each serves (or failed)."""
        wave = range(first, min(first + self.cfg.concurrent_servers, len(self._order)))
        servers: dict[int, tuple[LaunchSpec, LaunchedServer, float]] = {}
        for i in wave:
            rep, config = self._order[i]
            spec = self._spec(config)
            log_path = self.work_dir / f"{i:03d}-{config.name.replace(':', '_')}-rep{rep}.log"
            servers[i] = (spec, launch(self.launcher, spec, log_path), time.time())
        if self.progress is not None:
            self.progress.wave(list(servers), [f"{self._order[i][1].name} rep {self._order[i][0]}" for i in servers])
        for i, (spec, server, started_at) in servers.items():
            config = self._order[i][1]
            try:
                wait_healthy(server, client, self.cfg.health_timeout_s, self.cfg.health_poll_s)
            except ServerStartError as e:
                if config.is_baseline:  # without its baseline nothing of the wave can be judged
                    for _, other, _ in servers.values():
                        other.stop()
                    raise
                # reported (its log kept); the others go on
                self._started[i] = _Started(spec, None, started_at, error=str(e), log_path=str(server.log_path))
                continue
            self._started[i] = _Started(spec, server, started_at, health_s=time.time() - started_at)

    def _launch(self, client: httpx.Client, rep: int, config: BenchConfig, record: LaunchRecord) -> None:
        index = self._next
        self._next += 1
        assert self._order[index] == (rep, config), "run_protocol and the runner disagree on the order"
        if index not in self._started:
            self._start_wave(client, index)
        started = self._started.pop(index)
        record.started_at, server = started.started_at, started.server
        if server is None:
            record.error, record.log_path = started.error, started.log_path
            if self.progress is not None:
                self.progress.launch_done(index, record)
            return
        record.url, record.log_path, record.health_s = server.url, str(server.log_path), started.health_s
        if self.progress is not None:
            self.progress.measuring(index, config.name, rep, started.health_s)
        gpu = GpuSampler()
        gpu.start()
        try:
            self._measure(client, server.url, started.spec, config, rep, record)
        except GateStopped as e:
            if config.role == CANDIDATE:
                raise
            record.error = str(e)  # a draft from elsewhere that fails is reported, not fatal
        finally:
            record.gpu_samples = gpu.stop()
            for level in record.levels.values():
                level["gpu"] = window_summary(record.gpu_samples, level["began_at"], level["ended_at"])
            server.stop()
            record.ended_at = time.time()
            log = parse_server_log(server.log_text())
            record.log = log.to_dict(record.started_at)
            steps = config.spec.num_steps if config.spec else 0
            record.graph_problems = log.graph_problems(config.spec is not None, steps)
            if self.progress is not None:
                self.progress.launch_done(index, record)

    def _measure(
        self, client: httpx.Client, url: str, spec: LaunchSpec, config: BenchConfig, rep: int, record: LaunchRecord
    ) -> None:
        cfg = self.cfg
        record.server_info = fetch_server_info(client, url, self.launcher.version)
        record.info_problems = check_server_info(record.server_info, spec)
        record.info_notes = unreported_server_info(record.server_info, spec)
        record.max_running_requests = _positive_int(record.server_info.get("max_running_requests"))
        if record.info_problems:
            raise GateStopped(f"{config.name}: the server does not echo the launch: " + "; ".join(record.info_problems))
        warm = [self._request(client, url, config, -1, p) for p in self.prompts[: cfg.warmup_requests]]
        # Only the candidate's own configs stop the gate below the floor; a reference or a
        # small-data scaling draft is measured for what it is.
        floor = cfg.acceptance_floor if config.role == CANDIDATE else 1.0
        if config.spec is not None:
            record.warmup_accept_length = check_acceptance(floor, config, warm, "after warm-up")
        levels = load_levels(cfg, config)
        self._probe_costs(client, url, config, record)
        record.level_costs[str(levels[0])] = {"prefill_s": record.prefill_s, "step_s": record.step_s}
        for level in levels[1:]:
            record.level_costs[str(level)] = self._probe_level(client, url, config, record, level)
        record.measured_at = time.time()
        prompts = self.prompts[: cfg.breakeven_prompts] if config.role == BREAKEVEN else self.prompts
        for i, level in enumerate(levels):
            client.post(url + "/flush_cache", timeout=60.0).raise_for_status()
            record.requests += self._run_level(client, url, config, rep, prompts, level, record)
            # The references' re-score comes after the lowest level, before any later level of
            # the same launch is compared with them.
            if i == 0 and config.is_baseline:
                self._rescore(client, url, config, record)
        if config.spec is not None and not is_filler(config) and cfg.verify_logprobs != "off":
            self._verify_views(client, url, config, record)
        if config.spec is not None:
            check_acceptance(floor, config, record.requests, "over the measured requests")

    def _run_level(
        self, client: httpx.Client, url: str, config: BenchConfig, rep: int, prompts: list[BenchPrompt],
        level: int, record: LaunchRecord,
    ) -> list[RequestRecord]:  # fmt: skip
        """One load level: `level` requests in flight at a time (a closed loop: each one that ends
        is replaced) until level_requests(...) have run, the prompts in order and repeating;
        records the level's wall time and output throughput in record.levels."""
        n = level_requests(level, len(prompts))
        began_at, t0 = time.time(), time.perf_counter()
        if level == 1:
            out = [self._request(client, url, config, rep, prompts[j % len(prompts)], slot=j) for j in range(n)]
        else:
            with ThreadPoolExecutor(max_workers=level) as pool:
                out = list(pool.map(lambda j: self._request(client, url, config, rep, prompts[j % len(prompts)],
                                                            level=level, slot=j), range(n)))  # fmt: skip
        wall = time.perf_counter() - t0
        tokens = sum(r.completion_tokens for r in out if r.error is None)
        record.levels[str(level)] = {"concurrency": level, "requests": n, "errors": sum(r.error is not None for r in out),
                                     "wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall if wall > 0 else None,
                                     "began_at": began_at, "ended_at": began_at + wall}  # fmt: skip
        return out

    def _probe_level(
        self, client: httpx.Client, url: str, config: BenchConfig, record: LaunchRecord, level: int
    ) -> dict[str, float | None]:
        """A level's cost probe, on an empty cache, twice: `level` prompts at once with
        max_new_tokens 1 (their prefill), then the same run to max_new_tokens (ignore_eos, so the
        batch stays whole). The quicker of each (a stall of the server lengthens one batch, and
        once) and their difference over a request's mean decode steps (verify cycles: with a real
        draft the batch thins at its end, which the mean weighs as the closed loop never does)
        give one step's cost at that batch size."""
        prompts = [self.prompts[j % len(self.prompts)] for j in range(level)]

        def batch(max_new_tokens: int | None) -> tuple[float, list[RequestRecord]]:
            client.post(url + "/flush_cache", timeout=60.0).raise_for_status()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=level) as pool:
                recs = list(pool.map(lambda p: self._request(client, url, config, PROBE_REPETITION, p,
                                                             max_new_tokens or self.cfg.max_new_tokens,
                                                             level=level, ignore_eos=True), prompts))  # fmt: skip
            record.probes += recs
            return time.perf_counter() - t0, recs

        firsts, wholes = [], []
        for _ in range(2):
            firsts.append(batch(1))
            wholes.append(batch(None))
        if any(r.error for _, recs in firsts + wholes for r in recs):
            return {"prefill_s": None, "step_s": None}
        first_s = min(t for t, _ in firsts)
        whole_s, whole = min(wholes, key=lambda w: w[0])
        steps = statistics.mean(_cycles(r, config) for r in whole)
        step = (whole_s - first_s) / steps if steps > 0 else None
        return {"prefill_s": first_s, "step_s": step, "admit_s": self._probe_admissions(client, url, config, record, level, step)}

    def _probe_admissions(
        self, client: httpx.Client, url: str, config: BenchConfig, record: LaunchRecord, level: int, step: float | None
    ) -> float | None:
        """What admitting one request into a running batch of `level` costs the requests in it:
        4 x level requests (at least 8) in a closed loop of `level`, each to its own length
        (ignore_eos; a quarter to three quarters of max_new_tokens, spread), so that they end, and
        the next ones are admitted, one at a time, as real replies do. Each request's latency less
        a lone prefill (the concurrency-1 probe's) and its steps at the batch's step, summed, over
        the admissions its life saw (level - 1 each): seconds per admission (>= 0)."""
        lone = record.level_costs.get("1", {}).get("prefill_s")
        if step is None or lone is None or level < 2:
            return None
        n, top = max(4 * level, 8), self.cfg.max_new_tokens
        lengths = [max(2, round(top * (0.25 + 0.5 * ((j * 0.6180339887) % 1.0)))) for j in range(n)]
        client.post(url + "/flush_cache", timeout=60.0).raise_for_status()
        with ThreadPoolExecutor(max_workers=level) as pool:
            recs = list(pool.map(lambda j: self._request(client, url, config, PROBE_REPETITION, self.prompts[j % len(self.prompts)],
                                                         lengths[j], level=level, ignore_eos=True), range(n)))  # fmt: skip
        record.probes += recs
        if any(r.error for r in recs):
            return None
        stalls = sum(r.latency_s - lone - _cycles(r, config) * step for r in recs)
        return max(0.0, stalls / (n * (level - 1)))

    def _verify_views(self, client: httpx.Client, url: str, config: BenchConfig, record: LaunchRecord) -> None:
        """Untimed, after the measured requests: each one refused as not lossless (each that
        diverged, with gate.verify_logprobs "diverged") sent again on a cold cache with
        return_logprob; the speculative path's own view of its divergence goes into the
        divergence record as `verify` (lossless.verify_view), or why there is none."""
        by_index = {p.index: p for p in self.prompts}
        for rec in record.requests:
            div = rec.divergence
            if rec.error is not None or not div or (self.cfg.verify_logprobs == "refused" and div.get("cls") != NOT_LOSSLESS):
                continue
            reference = self.reference.reference(config.env_name, rec.prompt_index)
            evidence = self.reference.evidence(config.env_name, rec.prompt_index)
            if reference is None or not isinstance(evidence, ReferenceEvidence):
                div["verify"] = {"error": "no re-score of the reference to set it beside"}
                continue
            prompt = by_index[rec.prompt_index]
            rid = f"gate-verify-{config.name}-r{rec.repetition}-p{prompt.index}-{next(self._rids)}"
            body = verify_body(list(prompt.input_ids), self._sampling(config), self.cfg.top_logprobs_num, rid)
            try:
                client.post(url + "/flush_cache", timeout=60.0).raise_for_status()
                # A server that cannot answer logprobs under speculation must not hold the gate for
                # request_timeout_s: ten times the timed request's latency is ample.
                r = client.post(url + "/generate", json=body, timeout=max(30.0, 10 * rec.latency_s))
                if r.status_code != 200:
                    raise EvidenceError(f"HTTP {r.status_code}: {error_message(r.content)[:300]}")
                reply = read_generate_reply(r.content)
                div["verify"] = verify_view(div, reference, evidence, reply.output_ids, reply.logprobs)
            except (httpx.HTTPError, MalformedResponse, EvidenceError) as e:
                div["verify"] = {"error": f"{type(e).__name__}: {e}"}

    def _rescore(self, client: httpx.Client, url: str, config: BenchConfig, record: LaunchRecord) -> None:
        """The evidence of the lossless rule, untimed: the baseline's distribution at every
        position of each prompt's reference output (tasks/gate/lossless.py)."""
        got: list[ReferenceEvidence | str] = []
        first: list[ReferenceEvidence | str | None] = []
        for prompt in self.prompts:
            reference = self.reference.reference(config.env_name, prompt.index)
            if reference is None:  # its reference request failed
                continue
            ids = list(prompt.input_ids)
            rid = f"gate-rescore-{config.name}-p{prompt.index}-{next(self._rids)}"
            body = rescore_body(ids, reference, self.cfg.top_logprobs_num, rid)
            evidence: ReferenceEvidence | str
            try:
                r = client.post(url + "/generate", json=body)
                if r.status_code != 200:
                    raise EvidenceError(f"HTTP {r.status_code}: {error_message(r.content)[:300]}")
                evidence = evidence_from_sglang(read_generate_reply(r.content).logprobs, ids, reference, self.cfg.top_logprobs_num)
            except (httpx.HTTPError, MalformedResponse, EvidenceError) as e:
                evidence = f"re-score of prompt {prompt.index} failed: {type(e).__name__}: {e}"
            first.append(self.reference.evidence(config.env_name, prompt.index))
            self.reference.add_evidence(config.env_name, prompt.index, evidence)
            got.append(evidence)
        record.rescore = rescore_summary(got, first)

    def _probe_costs(self, client: httpx.Client, url: str, config: BenchConfig, record: LaunchRecord) -> None:
        """Per warm-up prompt, on an empty cache: the prefill alone (max_new_tokens 1), then the
        whole request; their latency difference over its decode steps (or verify cycles) is one
        step's cost, its prefill taken out."""
        prefills, steps = [], []
        for prompt in self.prompts[: self.cfg.warmup_requests]:
            client.post(url + "/flush_cache", timeout=60.0).raise_for_status()
            first = self._request(client, url, config, PROBE_REPETITION, prompt, max_new_tokens=1)
            client.post(url + "/flush_cache", timeout=60.0).raise_for_status()
            whole = self._request(client, url, config, PROBE_REPETITION, prompt)
            record.probes += [first, whole]
            if first.error or whole.error:
                continue
            cycles = whole.spec_verify_ct if config.spec is not None else whole.completion_tokens - 1
            prefills.append(first.latency_s)
            if cycles:
                steps.append((whole.latency_s - first.latency_s) / cycles)
        record.prefill_s = statistics.median(prefills) if prefills else None
        record.step_s = statistics.median(steps) if steps else None

    def _request(
        self, client: httpx.Client, url: str, config: BenchConfig, rep: int, prompt: BenchPrompt,
        max_new_tokens: int | None = None, *, level: int = 1, slot: int | None = None, ignore_eos: bool = False,
    ) -> RequestRecord:  # fmt: skip
        rec = RequestRecord(config.name, config.env_name, rep, prompt.index, prompt.prompt_id, prompt.domain,
                            concurrency=level, slot=slot)  # fmt: skip
        sampling = self._sampling(config, max_new_tokens or self._reply_tokens(prompt))
        if ignore_eos:
            sampling["ignore_eos"] = True
        body = {"input_ids": list(prompt.input_ids), "sampling_params": sampling,
                "rid": f"gate-{config.name}-r{rep}-p{prompt.index}-{next(self._rids)}"}  # fmt: skip
        rec.started_at, t0 = time.time(), time.perf_counter()
        try:
            r = client.post(url + "/generate", json=body)
        except httpx.HTTPError as e:
            rec.latency_s = time.perf_counter() - t0
            rec.error = f"{type(e).__name__}: {e}"
            return rec
        rec.latency_s = time.perf_counter() - t0
        ids = record_generate_answer(rec, r.status_code, r.content, config.spec)
        if ids is not None:
            self.reference.compare(rec, config, prompt, ids, rec.stop_token)
        return rec

    def _reply_tokens(self, prompt: BenchPrompt) -> int | None:
        """A rehearsal's reply length for `prompt` (gate.simulated_reply_tokens), else None."""
        lengths = self.cfg.simulated_reply_tokens
        return lengths[prompt.index % len(lengths)] if lengths else None

    def _sampling(self, config: BenchConfig, max_new_tokens: int | None = None) -> dict[str, object]:
        """A benchmark request's sampling params: greedy, the gate's penalty, filler runs to the end."""
        sampling: dict[str, object] = {"temperature": 0.0, "max_new_tokens": max_new_tokens or self.cfg.max_new_tokens}
        if self.cfg.frequency_penalty:
            sampling["frequency_penalty"] = self.cfg.frequency_penalty
        if config.role == BREAKEVEN or self.cfg.simulated_acceptance:  # filler runs to the end, and so does
            sampling["ignore_eos"] = True  # a rehearsal's baseline, for the same tokens per request
        return sampling


def _cycles(rec: RequestRecord, config: BenchConfig) -> int:
    """A request's decode steps (baseline) or verify cycles (speculative), its first token aside."""
    return (rec.spec_verify_ct or 0) if config.spec is not None else rec.completion_tokens - 1


def _positive_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def server_launcher(cfg: GateConfig, engine: str | None = None) -> Launcher:
    """What starts the gate's servers: real SGLang for engine "sglang" (gate.engine by default),
    else the package's emulator with gate.emulator's settings."""
    if (engine or cfg.engine) == "sglang":
        return SGLangLauncher(cfg.sglang_version, cfg.python)
    return EmulatedLauncher(cfg.sglang_version, dict(cfg.emulator))


def launch_spec(cfg: GateConfig, model_path: str, config: BenchConfig, ports: PortPool) -> LaunchSpec:
    """The launch of one config of the gate: its server settings, ports from `ports`."""
    return LaunchSpec(
        model_path=model_path, port=ports.http_port(), nccl_port=ports.nccl_port(),
        host=cfg.host, tp_size=cfg.tp_size,
        spec=config.spec, cuda_graph_max_bs=cfg.cuda_graph_max_bs,
        mem_fraction_static=cfg.mem_fraction_static, server=launch_server_settings(cfg, config),
        extra_args=tuple(cfg.extra_server_args),
        env={**cfg.env, **config.env}, adaptive_config=config.adaptive_config,
    )  # fmt: skip


def launch_server_settings(cfg: GateConfig, config: BenchConfig) -> ServerSettings:
    """gate.server, except that the serving policy's launch pair admits every request of the
    highest load level (SGLang 0.5.14 caps a speculative server at 48 running requests unless
    told otherwise: the policy ships with the cap it was verified at)."""
    if config.role != POLICY:
        return cfg.server
    need = max(cfg.concurrency)
    cap = cfg.server.max_running_requests
    return cfg.server if cap is not None and cap >= need else cfg.server.model_copy(update={"max_running_requests": need})


def record_generate_answer(rec: RequestRecord, status: int, body: bytes, spec: SpecParams | None) -> list[int] | None:
    """Fill `rec` (its latency_s already measured) from one /generate answer: finish reason,
    completion tokens, tok/s, the server's e2e latency and, from a speculative server's
    meta_info, spec_verify_ct, the accept length by our definition and the correct-drafts
    histogram (padded to num_steps + 1 entries: SGLang 0.5.14 drops trailing zero counts).
    Returns the output ids, or None with rec.error set (HTTP error, malformed body, abort)."""
    if status != 200:
        rec.error = f"HTTP {status}: {error_message(body)[:300]}"
        return None
    try:
        reply = read_generate_reply(body)
    except MalformedResponse as e:
        rec.error = f"{type(e).__name__}: {e}"
        return None
    rec.finish, rec.stop_token = reply.finish, reply.stop_token
    if reply.finish == "abort":
        rec.error = f"aborted: {reply.abort_message}"
        return None
    ids, meta = reply.output_ids, reply.meta
    rec.completion_tokens = reply.completion_tokens if reply.completion_tokens is not None else len(ids)
    rec.tok_s = rec.completion_tokens / rec.latency_s if rec.latency_s > 0 else None
    rec.server_e2e_latency_s = reply.e2e_latency
    if "spec_verify_ct" in meta:
        hist = meta.get("spec_correct_drafts_histogram", meta.get("spec_accept_histogram"))
        try:
            rec.spec_verify_ct = int(meta["spec_verify_ct"])
            counts = [int(x) for x in hist] if isinstance(hist, list) else None
        except (TypeError, ValueError):
            rec.error = f"malformed speculative meta_info: spec_verify_ct {meta['spec_verify_ct']!r}, histogram {hist!r}"
            return None
        rec.accept_length = accept_length(rec.completion_tokens, rec.spec_verify_ct)
        if counts is not None:
            width = spec.num_steps + 1 if spec is not None else len(counts)
            rec.correct_drafts_histogram = counts + [0] * (width - len(counts))
    rec.output_sha = hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]
    return ids
