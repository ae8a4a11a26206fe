"""`python -m sglang.launch_server` command lines for the pinned SGLang versions (docs/DESIGN.md §7).

Flag facts, read from SGLang's server_args.py and EAGLE worker, and for 0.5.14 from its recorded
`--help` (tests/fixtures/sglang-0.5.14/help.txt, shipped as tasks/data/sglang/flags-0.5.14.json):
- speculative decoding: `--speculative-algorithm EAGLE3` (an EAGLE-3 draft under `EAGLE` skips
  its fc layer and accepts ~1 token, with no error), `--speculative-draft-model-path`,
  `--speculative-num-steps`, `--speculative-eagle-topk`, `--speculative-num-draft-tokens`: all
  three numbers or none. With topk=1 SGLang silently forces draft tokens = steps + 1; the
  builder refuses the mismatch (or, asked to, corrects it and says so) instead.
- CUDA graphs and server settings per version: the flag table in tasks/sglang/versions.py.

Every flag the builder emits is checked against the version's known flags before a command is
returned; for a version with a recorded `--help` the extra server args are checked against it too.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass, field

from tasks.sglang.server_settings import ServerSettings
from tasks.sglang.versions import (
    GRPC_PORT_OFFSET,
    PINNED_VERSIONS,
    SETTING_FLAGS,
    LaunchError,
    check_extra_args,
    flag_set,
    settings_args,
)

SGLANG_MODULE = "sglang.launch_server"


@dataclass(frozen=True)
class SpecParams:
    draft_model_path: str
    num_steps: int
    topk: int
    num_draft_tokens: int
    algorithm: str = "EAGLE3"

    @property
    def label(self) -> str:
        return f"{self.algorithm.lower()}-s{self.num_steps}-k{self.topk}-n{self.num_draft_tokens}"


def resolve_spec(
    draft_model_path: str,
    num_steps: int,
    topk: int,
    num_draft_tokens: int | None = None,
    *,
    algorithm: str = "EAGLE3",
    correct: bool = False,
) -> tuple[SpecParams, list[str]]:
    """Checked speculative parameters and notes on what was filled in or corrected.

    topk=1 with num_draft_tokens != num_steps + 1 is refused (SGLang would silently use
    steps + 1) unless `correct`, which corrects it and returns a note saying so.
    """
    if algorithm != "EAGLE3":
        raise LaunchError(
            f"--speculative-algorithm {algorithm!r}: the gate benchmarks EAGLE-3 drafts, which need "
            f"EAGLE3 (under EAGLE the draft's fc layer is skipped and acceptance stays at ~1.0)"
        )
    if not draft_model_path:
        raise LaunchError("--speculative-draft-model-path is empty")
    if num_steps < 1:
        raise LaunchError(f"--speculative-num-steps must be >= 1, got {num_steps}")
    if topk < 1:
        raise LaunchError(f"--speculative-eagle-topk must be >= 1, got {topk}")
    notes: list[str] = []
    chain = num_steps + 1
    if num_draft_tokens is None:
        if topk > 1:
            raise LaunchError(
                f"--speculative-num-draft-tokens must be set with --speculative-eagle-topk {topk} "
                f"(SGLang takes all three speculative numbers or none)"
            )
        num_draft_tokens = chain
        notes.append(f"num_draft_tokens set to num_steps + 1 = {chain} (topk=1 chain)")
    elif topk == 1 and num_draft_tokens != chain:
        if not correct:
            raise LaunchError(
                f"--speculative-eagle-topk 1 needs --speculative-num-draft-tokens = num_steps + 1 = "
                f"{chain}, got {num_draft_tokens}; SGLang would silently use {chain}"
            )
        notes.append(
            f"num_draft_tokens corrected from {num_draft_tokens} to num_steps + 1 = {chain}: with "
            f"topk=1 SGLang would have forced it silently"
        )
        num_draft_tokens = chain
    elif num_draft_tokens < 2:
        raise LaunchError(f"--speculative-num-draft-tokens must be >= 2, got {num_draft_tokens}")
    return SpecParams(draft_model_path, num_steps, topk, num_draft_tokens, algorithm), notes


@dataclass(frozen=True)
class LaunchSpec:
    """One server launch. `env` is applied on top of the launching process's environment.
    `disable_cuda_graph` is the graphs-off comparison (every CUDA graph the version can switch
    off); `server` holds the settings that every launch of a run shares."""

    model_path: str
    port: int
    host: str = "127.0.0.1"
    nccl_port: int | None = None  # None: SGLang picks one (a race when servers start together)
    tp_size: int = 1
    spec: SpecParams | None = None
    cuda_graph_max_bs: int | None = 8
    disable_cuda_graph: bool = False
    mem_fraction_static: float | None = None
    server: ServerSettings = field(default_factory=ServerSettings)
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    # SGLang's batch-size-aware adaptive speculation (tasks/sglang/adaptive.py): the path of its
    # JSON config; the launch's num_steps must be one of its candidate steps.
    adaptive_config: str | None = None


def build_server_args(spec: LaunchSpec, version: str) -> list[str]:
    """The arguments after `python -m sglang.launch_server`."""
    flags = flag_set(version)
    if not spec.model_path:
        raise LaunchError("--model-path is empty")
    if not 0 < spec.port <= flags.max_port:
        why = "" if flags.max_port == 65535 else f" (SGLang {flags.version} also opens port + {GRPC_PORT_OFFSET} for gRPC)"
        raise LaunchError(f"--port must be 1..{flags.max_port}, got {spec.port}{why}")
    if spec.tp_size < 1:
        raise LaunchError(f"--tp-size must be >= 1, got {spec.tp_size}")
    check_extra_args(spec.extra_args, flags)
    args = ["--model-path", spec.model_path, "--host", spec.host, "--port", str(spec.port)]
    if spec.nccl_port is not None:
        if not 0 < spec.nccl_port <= 65535 or spec.nccl_port == spec.port:
            raise LaunchError(f"--nccl-port must be 1..65535 and differ from --port {spec.port}, got {spec.nccl_port}")
        args += ["--nccl-port", str(spec.nccl_port)]
    args += ["--tp-size", str(spec.tp_size)]
    if spec.mem_fraction_static is not None:
        args += ["--mem-fraction-static", str(spec.mem_fraction_static)]
    args += settings_args(spec.server.model_dump(), flags)
    if spec.disable_cuda_graph:
        args += [f for f in flags.disable_cuda_graph if f not in args]
    elif spec.cuda_graph_max_bs is not None:
        args += [flags.cuda_graph_max_bs, str(spec.cuda_graph_max_bs)]
    if spec.spec is not None:
        s = spec.spec
        # Re-check: a SpecParams built by hand must obey the same rules as resolve_spec's.
        resolve_spec(s.draft_model_path, s.num_steps, s.topk, s.num_draft_tokens, algorithm=s.algorithm)
        args += [
            "--speculative-algorithm", s.algorithm,
            "--speculative-draft-model-path", s.draft_model_path,
            "--speculative-num-steps", str(s.num_steps),
            "--speculative-eagle-topk", str(s.topk),
            "--speculative-num-draft-tokens", str(s.num_draft_tokens),
        ]  # fmt: skip
    if spec.adaptive_config is not None:
        args += adaptive_args(spec, flags.version)
    # The builder's own flags must be ones this version has (a wrong table entry fails here, in
    # a test, rather than in SGLang's argparse on a GPU node).
    unknown = [a for a in args if a.startswith("--") and a not in flags.known]
    if unknown:
        raise LaunchError(f"built flags {unknown} are not SGLang {flags.version} flags")
    aliases = [a for a in args if flags.recorded is not None and a in flags.recorded.deprecated]
    if aliases:
        raise LaunchError(f"built flags {aliases} are deprecated aliases in SGLang {flags.version}")
    return args + list(spec.extra_args)


def adaptive_args(spec: LaunchSpec, version: str) -> list[str]:
    """`--speculative-adaptive --speculative-adaptive-config PATH`, refused where 0.5.14 would
    refuse the launch or silently run it static: a version without the flags, no speculation, a
    tree (topk > 1), a num_steps outside the file's candidate steps, a file it would reject."""
    from tasks.sglang.adaptive import (
        ADAPTIVE_CONFIG_FLAG,
        ADAPTIVE_FLAG,
        ADAPTIVE_VERSIONS,
        AdaptiveConfig,
        AdaptiveConfigError,
    )

    if version not in ADAPTIVE_VERSIONS:
        raise LaunchError(f"{ADAPTIVE_FLAG}: SGLang {version} has no adaptive speculation (it came with 0.5.14)")
    if spec.spec is None:
        raise LaunchError(f"{ADAPTIVE_FLAG} needs speculative decoding: the launch has no draft")
    if spec.spec.topk != 1:
        raise LaunchError(
            f"{ADAPTIVE_FLAG} with --speculative-eagle-topk {spec.spec.topk}: SGLang 0.5.14 adapts chains "
            "(topk 1) only and would run the tree static, saying so in its log"
        )
    try:
        config = AdaptiveConfig.load(str(spec.adaptive_config))
    except (OSError, AdaptiveConfigError) as e:
        raise LaunchError(f"{ADAPTIVE_CONFIG_FLAG}: {e}") from None
    if spec.spec.num_steps not in config.candidate_steps:
        raise LaunchError(
            f"--speculative-num-steps {spec.spec.num_steps} is not one of the adaptive config's candidate steps "
            f"{config.candidate_steps}: SGLang 0.5.14 refuses to start"
        )
    return [ADAPTIVE_FLAG, ADAPTIVE_CONFIG_FLAG, str(spec.adaptive_config)]


def build_launch_command(spec: LaunchSpec, version: str, python: str = "python") -> list[str]:
    return [python, "-m", SGLANG_MODULE, *build_server_args(spec, version)]


# The command-line entry: what infra/sglang/launch_speculative.sh and launch_target.sh run, so an
# operator's launches and the gate's come from this one builder.
def _max_bs(value: str) -> int | None:
    if value == "default":
        return None
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'default', got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'default', got {value!r}")
    return n


def add_settings_arguments(p: argparse.ArgumentParser) -> None:
    """One option per ServerSettings field, named like its SGLang flag."""
    group = p.add_argument_group("server settings (gate.server in the params; unset: SGLang's default)")
    for name, info in ServerSettings.model_fields.items():
        flag = SETTING_FLAGS[name]
        if info.annotation is bool:
            group.add_argument(flag, dest=name, action="store_true", help=info.description)
        else:
            kind = int if name in ("max_total_tokens", "max_running_requests", "random_seed") else str
            group.add_argument(flag, dest=name, type=kind, default=None, help=info.description)


def _cli_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tasks.sglang.command",
        description="Print the `sglang.launch_server` command the gate builds, for an operator's "
        "launch (infra/sglang/launch_speculative.sh and launch_target.sh run it). Arguments after "
        "`--` are passed to SGLang unchanged (flags the builder owns are refused).",
    )
    p.add_argument("--model", help="HF model folder of the target (required)")
    p.add_argument("--draft", help="exported EAGLE3 draft folder (train/final or the promoted copy)")
    p.add_argument("--baseline", action="store_true", help="no speculation: the gate's baseline launch")
    p.add_argument("--sglang-version", default=PINNED_VERSIONS[-1], help=f"one of {list(PINNED_VERSIONS)} (default %(default)s)")
    p.add_argument("--num-steps", type=int, help="--speculative-num-steps (the gate's best; required with --draft)")
    p.add_argument("--topk", type=int, default=1, help="--speculative-eagle-topk (default 1)")
    p.add_argument("--num-draft-tokens", type=int, help="default num_steps + 1 when topk=1; required when topk > 1")
    p.add_argument("--correct-draft-tokens", action="store_true", help="with topk=1, correct a wrong --num-draft-tokens instead of refusing it")
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel size (default 8)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--mem-fraction", type=float, default=0.88, help="--mem-fraction-static (default 0.88)")
    p.add_argument("--cuda-graph-max-bs", type=_max_bs, default=8,
                   help="decode CUDA-graph batch sizes up to N (default 8, the gate's); 'default': SGLang's own")  # fmt: skip
    p.add_argument("--disable-cuda-graph", action="store_true", help="no CUDA graphs (the graphs-off comparison)")
    p.add_argument("--python", default="python", help="interpreter that has sglang (default python)")
    p.add_argument("--lines", action="store_true", help="one argument per line (for scripts) instead of a shell-quoted line")
    add_settings_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = _cli_parser()
    # Unknown options first: a misspelt --model should be named as such, not as a missing one.
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (SGLang flags go after --)")
    if not args.model:
        parser.error("--model is required")
    if args.baseline == bool(args.draft):
        parser.error("give exactly one of --draft PATH and --baseline")
    try:
        spec = None
        if args.draft:
            if args.num_steps is None:
                parser.error("--num-steps is required with --draft (use the gate's best config)")
            spec, notes = resolve_spec(
                args.draft, args.num_steps, args.topk, args.num_draft_tokens, correct=args.correct_draft_tokens
            )
            for note in notes:
                print(f"launch: {note}", file=sys.stderr)
        settings = ServerSettings(**{name: getattr(args, name) for name in ServerSettings.model_fields})
        launch = LaunchSpec(
            model_path=args.model, port=args.port, host=args.host, tp_size=args.tp, spec=spec,
            cuda_graph_max_bs=args.cuda_graph_max_bs, disable_cuda_graph=args.disable_cuda_graph,
            mem_fraction_static=args.mem_fraction, server=settings, extra_args=tuple(extra),
        )  # fmt: skip
        cmd = build_launch_command(launch, args.sglang_version, python=args.python)
    except LaunchError as e:
        print(f"launch: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # pydantic's ValidationError: a setting out of range
        print(f"launch: {e}", file=sys.stderr)
        return 2
    if args.lines:
        if any("\n" in a for a in cmd):
            print("launch: an argument contains a newline; use the shell-quoted form", file=sys.stderr)
            return 2
        print("\n".join(cmd))
    else:
        print(shlex.join(cmd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
