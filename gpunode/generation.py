"""Generation on the node: the SGLang server for the target, one plain batched /generate request
as the throughput reference (`node reference`), the generate stage against the server, watched
against the session's device time: a generation that would not end in its session is stopped
while its way back still fits, packed with its journals, and resumed by the next session's node.
A run that came without its discovery (a synthesized source) discovers first, on the same server,
its synthesis watched and set beside its own reference (`node synthesis-reference`) likewise."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpunode import node_env
from gpunode.core import STAGE_STOP_S, SessionEnds, end_process
from gpunode.node_env import read_json
from gpunode.travel import (
    GENERATION_STOPPED,
    carried_reuse,
    generation_bytes,
    generation_travel_s,
    pack_generation,
)

SGLANG = "0.5.14"  # the node's bundle: what the generation server runs
# The generation server runs this many requests at once; the engine keeps more in flight
# (engine.concurrency_per_server: 320 in the Qwen profile) so that a queue waits at the server and
# its scheduler prefills arrivals together (BENCHMARKS P8: with none queued, 0.70x one plain
# batched request).
SERVER_MAX_RUNNING = 256
# A generation that would not end in its session (a prompt per user turn: BENCHMARKS P21) is
# stopped while its way back still fits (watch_generation): STAGE_STOP_S bounds its stop. It is
# checked every GENERATION_POLL_S, against the bytes it would pack then times GENERATION_GROWTH
# (what is written while it stops).
GENERATION_STOP_S = STAGE_STOP_S
GENERATION_POLL_S = 5.0
GENERATION_GROWTH = 1.2


def generation_server_args(model_dir: str) -> list[str]:
    """The generation server's launch (infra/sglang/launch_target.sh): CUDA graphs up to the
    batch it runs, SERVER_MAX_RUNNING requests at once, no prefix cache (once finished requests
    filled the KV pool, every admission evicted and the pace fell to ~0.58x: BENCHMARKS P16)."""
    return [str(node_env.REPO / "infra/sglang/launch_target.sh"), "--model", model_dir, "--tp", "1",
            "--host", "127.0.0.1", "--port", str(node_env.PORT), "--mem-fraction", "0.5", "--sglang-version", SGLANG,
            "--cuda-graph-max-bs", str(SERVER_MAX_RUNNING), "--max-running-requests", str(SERVER_MAX_RUNNING),
            "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
            "--dtype", "bfloat16", "--skip-tokenizer-init", "--disable-prefill-cuda-graph", "--disable-radix-cache",
            "--python", sys.executable]  # fmt: skip


def _healthy() -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{node_env.PORT}/health_generate", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def synthesis_rate(run: Path, reference_tok_s: float | None) -> dict[str, Any]:
    """The synthesis' own rate in this session (synthesize/_COMPLETE's summary: the tokens it wrote
    over its wall time), beside one plain batched request of its shape on the same server."""
    done = read_json(run / "synthesize/_COMPLETE") or {}
    rate = done.get("tokens_per_s")
    return {"tok_s": rate, "written": done.get("written_this_run"), "seconds": done.get("seconds_this_run"),
            "reference_tok_s": reference_tok_s, "vs_reference": rate / reference_tok_s if rate and reference_tok_s else None}  # fmt: skip


class GenerationSteps:
    def start_server(self) -> None:
        self.note("sglang-server", "running")
        args = generation_server_args(self.model_dir)
        if node_env.REHEARSAL:
            args = [sys.executable, "-m", "flows.cli", "serve-sglang", "--model", self.model_dir,
                    "--host", "127.0.0.1", "--port", str(node_env.PORT), "--skip-tokenizer-init"]  # fmt: skip
        with (node_env.NODE / "logs" / "sglang-generate.log").open("ab") as f:
            self.server = subprocess.Popen(args, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                           start_new_session=True)  # fmt: skip
        began = time.time()
        while not _healthy():
            if self.server.poll() is not None:
                raise RuntimeError(f"the SGLang server exited {self.server.returncode} (logs/sglang-generate.log)")
            if time.time() - began > 900:
                raise RuntimeError("the SGLang server did not become healthy in 900 s")
            time.sleep(2)
        self.save_measure("generate_server_ready_s", time.time() - began)
        self.note("sglang-server", "done", f"ready after {time.time() - began:.0f} s")

    def stop_server(self) -> None:
        if self.server is not None and self.server.poll() is None:
            os.killpg(self.server.pid, signal.SIGTERM)
            try:
                self.server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.server.pid, signal.SIGKILL)
        self.server = None

    def reference(self, step: str = "reference", *args: str) -> None:
        """One plain batched /generate request (`node reference`: over the first prompts, the same
        rendering and sampling as the stage, at the server's concurrency, max-running-requests 256;
        `node synthesis-reference URL`: the synthesis' first slots), its figures into the measures."""
        self.note(step, "running")
        self.py(node_env.node_step(step, *args), step)
        result = read_json(node_env.NODE / f"{step}.json")
        self.measure.update(result or {})
        self.save_measure(f"{step.replace('-', '_')}_done", True)
        self.note(step, "done", json.dumps(result))

    def generate_once(self, reference: bool, while_up: Callable[[], None] | None = None) -> None:
        """The generation server, the plain batched request (`reference`) and `while_up` (what
        else needs the server before the stage loads it), the generate stage, the server stopped:
        nothing when the run came with its generation or has it already."""
        import yaml

        if self.done_before("generate") or self.generated():
            return
        engine = yaml.safe_load((node_env.NODE / "params.yaml").read_text())["engine"]
        self.save_measure("generate_concurrency", {"server_max_running": SERVER_MAX_RUNNING,
                                                   "engine_in_flight": engine.get("concurrency_per_server")})  # fmt: skip
        self.start_server()
        self.discover_here(f"http://127.0.0.1:{node_env.PORT}")
        if reference and not self.measure.get("reference_done"):
            self.reference()
        if while_up is not None:
            while_up()
        self.generate(f"http://127.0.0.1:{node_env.PORT}")
        self.stop_server()

    def discover_here(self, endpoint: str) -> None:
        """The discover stage on the node, for a run that came without its discovery (a profile
        with a synthesized source: payload.node_discovery): its synthesis writes the prompts on the
        generation server at `endpoint`, then discovery reads them beside the other sources, with
        prepare's settings (manifest.json's node_discovery). Watched as generation is: a synthesis
        its session cannot finish stops in time and travels with the journals of its uncommitted
        shards, and the next session's node resumes it from them."""
        if (self.run_root / "prompts/_SUCCESS.json").is_file():
            return
        if not self.measure.get("synthesis_reference_done") and not (self.run_root / "synthesize/_COMPLETE").is_file():
            self.reference("synthesis-reference", endpoint)
        sets = (read_json(node_env.NODE / "manifest.json") or {}).get("node_discovery") or []
        self.stage("discover", f"engine.endpoints=[{endpoint}]", *sets,
                   watch=lambda proc: self.watch_generation(proc, "discover"))  # fmt: skip
        self.save_measure("synthesis", synthesis_rate(self.run_root, self.measure.get("synthesis_reference_tok_s")))

    def generate(self, endpoint: str) -> None:
        """The generate stage against `endpoint`, watched against the session's device time
        (watch_generation), reusing the replies of the earlier run the payload carried (`prepare
        --reuse-from`: generate.reuse_from) for the prompts they share. A generation that an
        earlier pass on this machine stopped resumes here, so what that pass packed is dropped
        first: the one that travels is packed anew."""
        if (node_env.NODE / GENERATION_STOPPED).is_file():
            for stale in (node_env.NODE / "generation.tar", node_env.NODE / GENERATION_STOPPED):
                stale.unlink(missing_ok=True)
            shutil.rmtree(node_env.NODE / "generation", ignore_errors=True)
        reuse = [f"generate.reuse_from={path}"] if (path := carried_reuse()) else []  # prepare --reuse-from
        self.stage("generate", f"engine.endpoints=[{endpoint}]", *reuse, watch=self.watch_generation)

    def watch_generation(self, proc: subprocess.Popen[bytes], step: str = "generate") -> None:
        """Follows the generate stage to its end, unless the session's device time (`node start
        --budget`) would end before what it generated could come back: then it stops the stage
        (SIGTERM: every shard journals what it has and ends), packs the run's generation with the
        journals of its uncommitted shards (travel.pack_generation), records why in
        GENERATION_STOPPED and raises SessionEnds. `node wait` brings it back (`node generation K`
        when it is large), the next session's `prepare --run-from` carries it, and that node
        resumes it, sending only the requests no journal holds."""
        while proc.poll() is None:
            left = self.seconds_to_deadline()
            if left is not None:
                need = GENERATION_STOP_S + generation_travel_s(int(GENERATION_GROWTH * generation_bytes(self.run_root)))
                if left <= need:
                    self.stop_generation(proc, left, need, step)
            time.sleep(GENERATION_POLL_S)

    def stop_generation(self, proc: subprocess.Popen[bytes], left: float, need: float, step: str = "generate") -> None:
        """The stage `step` stopped (generate, or discover in its synthesis), the run's generation
        packed with its journals to travel, status.json saying so; raises SessionEnds."""
        end_process(proc, GENERATION_STOP_S)
        packed = node_env.NODE / "generation.tar"
        pack_generation(self.run_root, packed)
        shards = "generate" if step == "generate" else "synthesize"
        requests = (read_json(self.run_root / shards / "progress.json") or {}).get("requests", {})
        stopped = {"step": step, "stopped_at": time.time(), "seconds_left": left, "way_back_s": need,
                   "exit": proc.returncode, "bytes": packed.stat().st_size, "requests_done": requests.get("done"),
                   "requests_total": requests.get("total"),
                   "committed_shards": len(list((self.run_root / shards / "_SUCCESS").glob("*.json")))}  # fmt: skip
        (node_env.NODE / GENERATION_STOPPED).write_text(json.dumps(stopped, indent=1))
        self.save_measure("generation_stopped", stopped)
        what = "the generation" if step == "generate" else "the synthesis (before discovery)"
        counts = f"{requests['done']} of {requests['total']} requests, " if requests else ""  # a synthesis has no progress.json
        detail = (f"{left:.0f} s of device time left, ~{need:.0f} s to stop it and bring it back: stopped at "
                  f"{counts}{stopped['committed_shards']} shards committed; {what} travels (`node wait`, `node "
                  "generation K` when generation.txt says so) and the next session's `prepare --run-from` resumes it")  # fmt: skip
        self.note(step, "stopped", detail)
        raise SessionEnds(detail)
