"""The SGLang launch-command builder, per pinned version, and the emulator that takes its flags."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from tasks.config.gate_section import GateConfig, SpecPoint
from tasks.gate.plan import plan_configs
from tasks.sglang.command import (
    LaunchSpec,
    SpecParams,
    build_launch_command,
    build_server_args,
    resolve_spec,
)
from tasks.sglang.recorded_flags import extract_help_flags, recorded_flags
from tasks.sglang.server_process import (
    EmulatedLauncher,
    PortPool,
    ServerStartError,
    check_server_info,
    fetch_server_info,
    free_port,
    launch,
    parse_server_log,
    wait_healthy,
)
from tasks.sglang.server_settings import ServerSettings
from tasks.sglang.versions import (
    GRPC_PORT_OFFSET,
    PINNED_VERSIONS,
    SETTING_FLAGS,
    LaunchError,
    flag_set,
)

ROOT = Path(__file__).resolve().parents[1]
SPEC = SpecParams("/drafts/d1", num_steps=3, topk=1, num_draft_tokens=4)
# What a real SGLang 0.5.14 `launch_server --help` printed on the H200 node (not the shipped data
# file: the tests below check the shipped file against this).
HELP_0514 = extract_help_flags((ROOT / "tests/fixtures/sglang-0.5.14/help.txt").read_text())
# The H200 node's settings (its bundle has no FA3 kernels, flashinfer is imported only).
H200 = ServerSettings(attention_backend="triton", sampling_backend="pytorch", grammar_backend="none",
                      skip_tokenizer_init=True, dtype="bfloat16")  # fmt: skip
EVERY_SETTING = ServerSettings(
    attention_backend="triton", sampling_backend="pytorch", grammar_backend="none", skip_tokenizer_init=True,
    dtype="bfloat16", disable_prefill_cuda_graph=True, sleep_on_idle=True, disable_radix_cache=True,
    max_total_tokens=65536, max_running_requests=8, random_seed=7,
)  # fmt: skip


def flag_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_0_5_4_uses_the_old_cuda_graph_flags() -> None:
    cmd = build_launch_command(LaunchSpec("/models/t", 30000, spec=SPEC, cuda_graph_max_bs=4), "0.5.4", python="py")
    assert cmd[:3] == ["py", "-m", "sglang.launch_server"]
    assert flag_value(cmd, "--cuda-graph-max-bs") == "4"
    assert "--cuda-graph-max-bs-decode" not in cmd and "--disable-decode-cuda-graph" not in cmd
    assert flag_value(cmd, "--speculative-algorithm") == "EAGLE3"
    assert flag_value(cmd, "--speculative-draft-model-path") == "/drafts/d1"
    assert (flag_value(cmd, "--speculative-num-steps"), flag_value(cmd, "--speculative-eagle-topk"),
            flag_value(cmd, "--speculative-num-draft-tokens")) == ("3", "1", "4")  # fmt: skip
    off = build_server_args(LaunchSpec("/models/t", 30000, disable_cuda_graph=True), "0.5.4")
    assert "--disable-cuda-graph" in off and "--cuda-graph-max-bs" not in off


def test_0_5_23_uses_the_decode_cuda_graph_flags() -> None:
    args = build_server_args(LaunchSpec("/models/t", 30001, spec=SPEC, cuda_graph_max_bs=2, tp_size=8), "0.5.23")
    assert flag_value(args, "--cuda-graph-max-bs-decode") == "2"
    assert "--cuda-graph-max-bs" not in args and "--disable-cuda-graph" not in args
    assert flag_value(args, "--tp-size") == "8" and flag_value(args, "--port") == "30001"
    off = build_server_args(LaunchSpec("/models/t", 30000, disable_cuda_graph=True), "0.5.23")
    assert "--disable-decode-cuda-graph" in off and "--cuda-graph-max-bs-decode" not in off
    baseline = build_server_args(LaunchSpec("/models/t", 30000), "0.5.23")
    assert not [a for a in baseline if a.startswith("--speculative")]


SPEC_ARGS = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/drafts/d1",
             "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]  # fmt: skip
BASE_ARGS = ["--model-path", "/m", "--host", "127.0.0.1", "--port", "30000", "--tp-size", "1"]


@pytest.mark.parametrize(
    ("version", "graphs_on", "graphs_off"),
    [
        ("0.5.4", ["--cuda-graph-max-bs", "8"], ["--disable-cuda-graph"]),
        ("0.5.14", ["--cuda-graph-max-bs-decode", "8"], ["--disable-decode-cuda-graph", "--disable-prefill-cuda-graph"]),
        ("0.5.23", ["--cuda-graph-max-bs-decode", "8"], ["--disable-decode-cuda-graph"]),
    ],
)  # fmt: skip
def test_each_versions_baseline_and_speculative_commands(version: str, graphs_on: list[str], graphs_off: list[str]) -> None:
    """The exact arguments per version with the default settings (nothing beyond the builder's own)."""
    assert build_server_args(LaunchSpec("/m", 30000), version) == BASE_ARGS + graphs_on
    assert build_server_args(LaunchSpec("/m", 30000, spec=SPEC), version) == BASE_ARGS + graphs_on + SPEC_ARGS
    assert build_server_args(LaunchSpec("/m", 30000, spec=SPEC, disable_cuda_graph=True), version) == (
        BASE_ARGS + graphs_off + SPEC_ARGS)  # fmt: skip


def test_the_shipped_0_5_14_flags_are_the_recorded_help() -> None:
    shipped = json.loads((ROOT / "tasks/data/sglang/flags-0.5.14.json").read_text())
    assert shipped["version"] == "0.5.14"
    assert {k: shipped[k] for k in ("flags", "choices", "deprecated")} == HELP_0514
    recorded = recorded_flags("0.5.14")
    assert recorded is not None and recorded.flags == set(HELP_0514["flags"])
    assert recorded_flags("0.5.23") is None  # no --help of it was recorded
    # Facts the builder relies on, as the real help states them.
    assert {"--cuda-graph-max-bs-decode", "--disable-decode-cuda-graph", "--disable-prefill-cuda-graph",
            "--tensor-parallel-size", "--skip-tokenizer-init", "--sleep-on-idle"} <= recorded.flags  # fmt: skip
    assert recorded.deprecated["--cuda-graph-max-bs"] == ("--cuda-graph-max-bs-decode",)
    assert recorded.deprecated["--disable-cuda-graph"] == ("--cuda-graph-backend-{decode,prefill}=disabled",)
    assert "--tp" not in recorded.flags and "--help" not in recorded.flags
    assert recorded.choices["--grammar-backend"] == ("xgrammar", "outlines", "llguidance", "none")


def _setting_variants() -> list[ServerSettings]:
    """No settings, each setting alone, all of them."""
    alone = [ServerSettings(**{name: getattr(EVERY_SETTING, name)}) for name in ServerSettings.model_fields]
    return [ServerSettings(), *alone, EVERY_SETTING]


def test_every_0_5_14_launch_the_gate_can_build_has_only_recorded_flags() -> None:
    """Baseline, EAGLE3 chains (topk 1) and trees (topk > 1), graphs on and off, every server
    setting: each emitted flag is in the recorded --help, none is a deprecated alias, and a value
    of a flag with choices is one of them."""
    flags, deprecated, choices = set(HELP_0514["flags"]), set(HELP_0514["deprecated"]), HELP_0514["choices"]
    cfg = GateConfig(engine="sglang", sglang_version="0.5.14", num_steps=[1, 2, 3, 5],
                     topk_points=[SpecPoint(num_steps=3, topk=4, num_draft_tokens=8),
                                  SpecPoint(num_steps=2, topk=2, num_draft_tokens=4)])  # fmt: skip
    configs = plan_configs(cfg, "/drafts/d")
    assert sum(c.spec is None for c in configs) == 1 and sum(bool(c.spec and c.spec.topk > 1) for c in configs) == 2
    seen: set[str] = set()
    for config in configs:
        for graphs_off in (False, True):
            for settings in _setting_variants():
                spec = LaunchSpec("/models/t", 30000, tp_size=2, spec=config.spec, cuda_graph_max_bs=cfg.cuda_graph_max_bs,
                                  disable_cuda_graph=graphs_off, mem_fraction_static=0.8, server=settings)  # fmt: skip
                args = build_server_args(spec, "0.5.14")
                for i, arg in enumerate(args):
                    if arg.startswith("--"):
                        assert arg in flags and arg not in deprecated, (config.name, arg)
                        if arg in choices:
                            assert args[i + 1] in choices[arg], (arg, args[i + 1])
                        seen.add(arg)
    # Every flag the builder has for 0.5.14 was among those checked.
    assert seen >= {*SETTING_FLAGS.values(), *flag_set("0.5.14").disable_cuda_graph, "--cuda-graph-max-bs-decode",
                    "--speculative-eagle-topk", "--mem-fraction-static"}  # fmt: skip


def test_the_h200_settings_rebuild_the_launch_that_worked() -> None:
    """The command that served on the H200 (its notes, 2026-12-01) is what the builder makes of
    the H200 settings, plus the builder's explicit --tp-size 1."""
    worked = ("--model-path MODEL --skip-tokenizer-init --attention-backend triton --sampling-backend pytorch "
              "--grammar-backend none --host 127.0.0.1 --port 30000 --mem-fraction-static 0.5 "
              "--cuda-graph-max-bs-decode 256 --dtype bfloat16 --speculative-algorithm EAGLE3 "
              "--speculative-draft-model-path DRAFT --speculative-num-steps 2 --speculative-eagle-topk 1 "
              "--speculative-num-draft-tokens 3")  # fmt: skip
    worked_args = shlex.split(worked)

    def pairs(args: list[str]) -> dict[str, str | None]:
        return {a: (args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None)
                for i, a in enumerate(args) if a.startswith("--")}  # fmt: skip

    spec, _ = resolve_spec("DRAFT", 2, 1)
    built = build_server_args(LaunchSpec("MODEL", 30000, spec=spec, cuda_graph_max_bs=256, mem_fraction_static=0.5,
                                         server=H200), "0.5.14")  # fmt: skip
    assert pairs(built) == {**pairs(worked_args), "--tp-size": "1"}
    assert len(built) == len(worked_args) + 2


def test_0_5_14_refuses_deprecated_unknown_and_out_of_choice_flags() -> None:
    def build(*extra: str, server: ServerSettings | None = None) -> list[str]:
        return build_server_args(LaunchSpec("/m", 30000, server=server or ServerSettings(), extra_args=extra), "0.5.14")

    with pytest.raises(LaunchError, match=r"--cuda-graph-max-bs is a deprecated alias in SGLang 0\.5\.14: use "
                                          r"--cuda-graph-max-bs-decode instead \(the gate sets it from cuda_graph_max_bs\)"):
        build("--cuda-graph-max-bs", "8")
    with pytest.raises(LaunchError, match=r"--disable-cuda-graph is a deprecated alias in SGLang 0\.5\.14: use "
                                          r"--cuda-graph-backend-\{decode,prefill\}=disabled instead"):
        build("--disable-cuda-graph")
    with pytest.raises(LaunchError, match=r"--piecewise-cuda-graph-max-tokens is a deprecated alias .* use --cuda-graph-max-bs-prefill"):
        build("--piecewise-cuda-graph-max-tokens=512")
    with pytest.raises(LaunchError, match=r"extra server arg --foo is not an SGLang 0\.5\.14 flag \(not in its recorded --help\)"):
        build("--foo")
    with pytest.raises(LaunchError, match=r"extra server arg --tp is not an SGLang 0\.5\.14 flag"):
        build("--tp", "2")
    with pytest.raises(LaunchError, match=r"extra server arg: --kv-cache-dtype 'fp9' is not one of SGLang 0\.5\.14's choices"):
        build("--kv-cache-dtype=fp9")
    with pytest.raises(LaunchError, match=r"--cuda-graph-backend-decode is set by the gate itself"):
        build("--cuda-graph-backend-decode", "disabled")
    with pytest.raises(LaunchError, match=r"--skip-tokenizer-init is the server setting skip_tokenizer_init"):
        build("--skip-tokenizer-init")
    with pytest.raises(LaunchError, match=r"server setting attention_backend: --attention-backend 'fa5' is not one of"):
        build(server=ServerSettings(attention_backend="fa5"))
    assert build("--kv-cache-dtype", "fp8_e4m3", "--trust-remote-code")[-3:] == ["--kv-cache-dtype", "fp8_e4m3", "--trust-remote-code"]


def test_server_settings_per_version() -> None:
    # One flag per setting, named like it (a setting without a flag would silently do nothing).
    assert {name: "--" + name.replace("_", "-") for name in ServerSettings.model_fields} == SETTING_FLAGS
    s = ServerSettings(attention_backend="triton", skip_tokenizer_init=True, sleep_on_idle=True, random_seed=3,
                       max_running_requests=4, max_total_tokens=4096, dtype="bfloat16", disable_radix_cache=True)  # fmt: skip
    for version in PINNED_VERSIONS:
        args = build_server_args(LaunchSpec("/m", 30000, server=s), version)
        assert flag_value(args, "--attention-backend") == "triton" and flag_value(args, "--random-seed") == "3"
        assert flag_value(args, "--max-running-requests") == "4" and flag_value(args, "--max-total-tokens") == "4096"
        assert "--skip-tokenizer-init" in args and "--sleep-on-idle" in args and "--disable-radix-cache" in args
    assert "--disable-radix-cache" not in build_server_args(LaunchSpec("/m", 30000, server=ServerSettings()), "0.5.14")
    prefill = ServerSettings(disable_prefill_cuda_graph=True)
    with pytest.raises(LaunchError, match=r"server setting disable_prefill_cuda_graph: SGLang 0\.5\.4 has no "
                                          r"--disable-prefill-cuda-graph \(0\.5\.4 captures prefill graphs only with"):
        build_server_args(LaunchSpec("/m", 30000, server=prefill), "0.5.4")
    assert "--disable-prefill-cuda-graph" in build_server_args(LaunchSpec("/m", 30000, server=prefill), "0.5.23")
    # Without a recorded --help a value cannot be checked; it goes to SGLang, which decides.
    assert flag_value(build_server_args(LaunchSpec("/m", 30000, server=ServerSettings(attention_backend="fa5")), "0.5.23"),
                      "--attention-backend") == "fa5"  # fmt: skip
    with pytest.raises(ValidationError, match="max_total_tokens"):
        ServerSettings(max_total_tokens=0)
    with pytest.raises(ValidationError, match="attention_backnd"):
        ServerSettings(attention_backnd="triton")  # type: ignore[call-arg]


def test_gate_config_checks_settings_and_extra_args_when_loaded() -> None:
    with pytest.raises(ValidationError, match=r"--foo is not an SGLang 0\.5\.14 flag"):
        GateConfig(sglang_version="0.5.14", extra_server_args=["--foo"])
    with pytest.raises(ValidationError, match=r"deprecated alias in SGLang 0\.5\.14: use --cuda-graph-max-bs-decode"):
        GateConfig(sglang_version="0.5.14", extra_server_args=["--cuda-graph-max-bs", "8"])
    with pytest.raises(ValidationError, match=r"SGLang 0\.5\.4 has no --disable-prefill-cuda-graph"):
        GateConfig(sglang_version="0.5.4", server={"disable_prefill_cuda_graph": True})
    with pytest.raises(ValidationError, match=r"server\.attention_backnd"):
        GateConfig(server={"attention_backnd": "triton"})
    cfg = GateConfig(engine="sglang", sglang_version="0.5.14", server={"attention_backend": "triton", "dtype": "bfloat16"},
                     extra_server_args=["--trust-remote-code", "--context-length", "4096"])  # fmt: skip
    assert cfg.server.attention_backend == "triton" and cfg.server.skip_tokenizer_init is False


def test_versions_are_pinned() -> None:
    assert flag_set("v0.5.4.post1").version == "0.5.4"
    assert flag_set("0.5.14.post2").version == "0.5.14"
    assert flag_set("0.5.23rc1").version == "0.5.23"
    with pytest.raises(LaunchError, match=r"'0\.5\.9' is not pinned.*\['0\.5\.4', '0\.5\.14', '0\.5\.23'\]"):
        flag_set("0.5.9")
    with pytest.raises(ValueError, match="sglang_version"):
        GateConfig(sglang_version="0.4.0")
    assert GateConfig(engine="sglang", sglang_version="0.5.14").sglang_version == "0.5.14"


def test_extra_args_may_not_carry_foreign_or_managed_flags() -> None:
    with pytest.raises(LaunchError, match=r"--cuda-graph-max-bs is not an SGLang 0\.5\.23 flag"):
        build_server_args(LaunchSpec("/m", 30000, extra_args=("--cuda-graph-max-bs", "8")), "0.5.23")
    with pytest.raises(LaunchError, match=r"--disable-decode-cuda-graph is not an SGLang 0\.5\.4 flag"):
        build_server_args(LaunchSpec("/m", 30000, extra_args=("--disable-decode-cuda-graph",)), "0.5.4")
    with pytest.raises(LaunchError, match="--speculative-num-steps is set by the gate itself"):
        build_server_args(LaunchSpec("/m", 30000, extra_args=("--speculative-num-steps=2",)), "0.5.23")
    # A server setting's flag belongs to the setting, not to extra args.
    with pytest.raises(LaunchError, match=r"--attention-backend is the server setting attention_backend: set it there"):
        build_server_args(LaunchSpec("/m", 30000, extra_args=("--attention-backend", "fa3")), "0.5.23")
    ok = build_server_args(LaunchSpec("/m", 30000, extra_args=("--trust-remote-code",)), "0.5.23")
    assert ok[-1:] == ["--trust-remote-code"]


def test_spec_resolution_refuses_or_corrects_the_topk1_coercion() -> None:
    spec, notes = resolve_spec("/d", 3, 1)
    assert spec.num_draft_tokens == 4 and notes == ["num_draft_tokens set to num_steps + 1 = 4 (topk=1 chain)"]
    with pytest.raises(LaunchError, match=r"= num_steps \+ 1 = 4, got 6; SGLang would silently use 4"):
        resolve_spec("/d", 3, 1, 6)
    fixed, notes = resolve_spec("/d", 3, 1, 6, correct=True)
    assert fixed.num_draft_tokens == 4 and "corrected from 6 to num_steps + 1 = 4" in notes[0]
    with pytest.raises(LaunchError, match="must be set with --speculative-eagle-topk 4"):
        resolve_spec("/d", 3, 4)
    tree, notes = resolve_spec("/d", 3, 4, 8)
    assert (tree.topk, tree.num_draft_tokens, notes) == (4, 8, [])
    with pytest.raises(LaunchError, match="'EAGLE': the gate benchmarks EAGLE-3 drafts, which need EAGLE3"):
        resolve_spec("/d", 3, 1, algorithm="EAGLE")
    # A hand-built SpecParams goes through the same rule when the command is built.
    with pytest.raises(LaunchError, match="got 6"):
        build_server_args(LaunchSpec("/m", 30000, spec=SpecParams("/d", 3, 1, 6)), "0.5.4")


@pytest.mark.parametrize("version", ["0.5.4", "0.5.14", "0.5.23"])
def test_the_emulator_takes_each_versions_command(version: str, tmp_path: Path) -> None:
    """A built command launches the emulator of that version, whose server info echoes it."""
    launcher = EmulatedLauncher(version, {"decode_log_interval": 2})
    spec = LaunchSpec("/models/t", free_port(), spec=SPEC, cuda_graph_max_bs=4, env={"NCCL_ALGO": "Ring"})
    server = launch(launcher, spec, tmp_path / "server.log")
    try:
        with httpx.Client(trust_env=False) as client:
            wait_healthy(server, client, timeout_s=30, poll_s=0.05)
            info = fetch_server_info(client, server.url, version)
    finally:
        server.stop()
    assert check_server_info(info, spec) == []
    assert info["version"] == version
    assert info["cuda_graph_max_bs" if version == "0.5.4" else "cuda_graph_max_bs_decode"] == 4
    assert info["eaglescale_env"] == {"NCCL_ALGO": "Ring"}
    assert not server.alive()


def test_the_emulator_rejects_the_old_flag_on_0_5_23() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tasks.standins.spec_launch", "--sim-config-json", '{"sglang_version": "0.5.23"}',
         "--model-path", "/m", "--cuda-graph-max-bs", "8"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "unrecognized arguments: --cuda-graph-max-bs 8" in proc.stderr


def _emulate(version: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The emulator's command line only: `--help`-style exits happen before it serves."""
    return subprocess.run(
        [sys.executable, "-m", "tasks.standins.spec_launch", "--sim-config-json",
         json.dumps({"sglang_version": version}), "--model-path", "/m", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_the_0_5_14_emulator_takes_exactly_the_recorded_flags() -> None:
    unknown = _emulate("0.5.14", "--foo")
    assert unknown.returncode == 2 and "unrecognized arguments: --foo" in unknown.stderr
    choice = _emulate("0.5.14", "--attention-backend", "fa9")
    assert choice.returncode == 2 and "invalid choice: 'fa9'" in choice.stderr
    old_alias = _emulate("0.5.14", "--tp", "2")  # 0.5.14 lists --tp-size and --tensor-parallel-size only
    assert old_alias.returncode == 2 and "unrecognized arguments: --tp 2" in old_alias.stderr


def test_regenerating_the_flag_file_gives_the_shipped_one(capsys: pytest.CaptureFixture[str]) -> None:
    from tasks.sglang.recorded_flags import main

    shipped = json.loads((ROOT / "tasks/data/sglang/flags-0.5.14.json").read_text())
    assert main([str(ROOT / "tests/fixtures/sglang-0.5.14/help.txt"), "0.5.14", shipped["source"]]) == 0
    assert json.loads(capsys.readouterr().out) == shipped


def test_server_info_check_catches_sglangs_silent_adjustment(tmp_path: Path) -> None:
    """Bypassing the builder's guard: SGLang (emulated) forces draft tokens to steps+1 and the
    server-info check names the difference."""
    spec = LaunchSpec("/m", free_port(), spec=SPEC)
    launcher = EmulatedLauncher("0.5.23")
    args = build_server_args(spec, "0.5.23")
    args[args.index("--speculative-num-draft-tokens") + 1] = "6"
    launcher.command = lambda _spec: [sys.executable, "-m", "tasks.standins.spec_launch",  # type: ignore[method-assign]
                                      "--sim-config-json", "{}", *args]  # fmt: skip
    server = launch(launcher, spec, tmp_path / "adjusted.log")
    try:
        with httpx.Client(trust_env=False) as client:
            wait_healthy(server, client, timeout_s=30, poll_s=0.05)
            info = fetch_server_info(client, server.url, "0.5.23")
    finally:
        server.stop()
    declared = SpecParams("/drafts/d1", 3, 1, 6)
    problems = check_server_info(info, LaunchSpec("/m", spec.port, spec=declared))
    assert problems == ["server info speculative_num_draft_tokens is 4, expected 6"]
    assert "speculative_num_draft_tokens is adjusted to speculative_num_steps + 1" in server.log_text()


OLD_LOG = """\
[2025-10-20 10:00:00 TP0] Capture cuda graph begin. This can take up to several minutes. avail mem=70.00 GB
[2025-10-20 10:00:09 TP0] Capture cuda graph end. Time elapsed: 9.12 s. mem usage=0.50 GB. avail mem=69.50 GB.
[2025-10-20 10:00:09 TP0] Capture draft cuda graph begin. This can take up to several minutes. avail mem=69.50 GB
[2025-10-20 10:00:15 TP0] Capture draft cuda graph end. Time elapsed: 6.00 s. avail mem=69.00 GB. mem usage=0.50 GB.
[2025-10-20 10:00:15 TP0] Capture draft extend cuda graph begin. This can take up to several minutes. avail mem=69.00 GB
[2025-10-20 10:01:00 TP0] Decode batch. #running-req: 1, #token: 300, token usage: 0.00, accept len: 2.10, \
cuda graph: True, gen throughput (token/s): 74.90, #queue-req: 0,
[2025-10-20 10:01:09 TP0] Decode batch. #running-req: 1, #token: 340, token usage: 0.00, accept len: 1.00, \
cuda graph: False, gen throughput (token/s): 50.00, #queue-req: 0,
"""
NEW_LOG = """\
[2026-01-01 10:00:00 TP0] Capture target prefill CUDA graph begin. backend=breakable, num_tokens=[8192], avail mem=70.00 GB
[2026-01-01 10:00:05 TP0] Capture target prefill CUDA graph end. elapsed=5.00 s, mem usage=1.00 GB, avail mem=69.00 GB.
[2026-01-01 10:00:05 TP0] Capture target verify CUDA graph begin. backend=full, num_tokens_per_req=4, bs=[1, 2], avail mem=69.00 GB
[2026-01-01 10:00:09 TP0] Capture target verify CUDA graph end. elapsed=4.00 s, mem usage=0.50 GB, avail mem=68.50 GB.
[2026-01-01 10:01:00 TP0] Decode batch, #running-req: 1, #token: 300, token usage: 0.00, accept len: 3.20, \
accept rate: 0.73, cuda graph: True, gen throughput (token/s): 120.00, #queue-req: 0
"""


def test_server_log_parsing_in_both_wordings() -> None:
    old = parse_server_log(OLD_LOG)
    assert old.captures == {"target": {"begin": 1, "end": 1}, "draft": {"begin": 1, "end": 1},
                            "draft_extend": {"begin": 1, "end": 0}, "prefill": {"begin": 0, "end": 0}}  # fmt: skip
    assert [(d.accept_len, d.cuda_graph, d.gen_throughput) for d in old.decode] == [(2.1, True, 74.9), (1.0, False, 50.0)]
    assert old.graph_problems(speculative=True, num_steps=3) == ["draft extend CUDA-graph capture began but never ended"]
    assert old.graph_problems(speculative=False) == []

    new = parse_server_log(NEW_LOG)
    assert new.captures["target"] == {"begin": 1, "end": 1} and new.captures["prefill"] == {"begin": 1, "end": 1}
    assert [(d.accept_len, d.cuda_graph) for d in new.decode] == [(3.2, True)]
    # num_steps 1: SGLang captures no multi-step draft graph, but the draft-extend graph is required.
    assert new.graph_problems(speculative=True, num_steps=1) == ["no draft extend CUDA-graph capture in the server log"]
    assert new.graph_problems(speculative=True, num_steps=2) == [
        "no draft extend CUDA-graph capture in the server log", "no draft CUDA-graph capture in the server log"]
    eager = parse_server_log("[t TP0] Decode batch, #running-req: 1, cuda graph: False, gen throughput (token/s): 1.00\n" * 2)
    assert eager.graph_problems(speculative=False) == [
        "no target CUDA-graph capture in the server log", "all 2 decode log lines say cuda graph: False"]


def test_a_key_the_server_info_omits_is_unverified_not_a_mismatch() -> None:
    from tasks.sglang.server_process import unreported_server_info

    spec = LaunchSpec("/m", 30000, spec=SpecParams("/drafts/d1", 3, 1, 4))
    info = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3}
    assert check_server_info(info, spec) == []
    assert unreported_server_info(info, spec) == [
        "server info has no speculative_draft_model_path", "server info has no speculative_eagle_topk",
        "server info has no speculative_num_draft_tokens",
    ]
    assert check_server_info({**info, "speculative_algorithm": "EAGLE"}, spec) == [
        "server info speculative_algorithm is 'EAGLE', expected 'EAGLE3'"
    ]


def test_a_port_whose_grpc_twin_would_pass_65535_is_refused_and_never_picked() -> None:
    """SGLang 0.5.14 opens a gRPC port at the HTTP port + 10000 and exits when that passes 65535
    (seen on the H200 with port 56049: "SGLANG_GRPC_PORT (66049) must be between 1 and 65535")."""
    with pytest.raises(LaunchError, match=r"--port must be 1..55535, got 56049 \(SGLang 0.5.14 also opens port \+ 10000"):
        build_server_args(LaunchSpec("/m", 56049), "0.5.14")
    assert "--port" in build_server_args(LaunchSpec("/m", 56049), "0.5.4")
    assert all(20000 <= free_port() <= 55535 for _ in range(50))


@pytest.mark.parametrize("version", PINNED_VERSIONS)
def test_each_launch_names_its_own_nccl_port(version: str) -> None:
    """--nccl-port is a flag of every pinned version (0.5.14's recorded --help has it) and must
    differ from the HTTP port."""
    args = build_server_args(LaunchSpec("/m", 21000, nccl_port=23456, spec=SPEC), version)
    assert flag_value(args, "--nccl-port") == "23456"
    assert "--nccl-port" not in build_server_args(LaunchSpec("/m", 21000), version)
    with pytest.raises(LaunchError, match="--nccl-port must be 1..65535 and differ from --port 21000, got 21000"):
        build_server_args(LaunchSpec("/m", 21000, nccl_port=21000), version)
    assert "--nccl-port" in HELP_0514["flags"]


def test_the_port_pool_hands_out_distinct_ports_below_the_ephemeral_range() -> None:
    """Ten servers' HTTP, gRPC (+10000) and NCCL ports: thirty distinct ports, none in the
    kernel's range for port-0 binds and outgoing connections (the sixth real run's collision)."""
    pool = PortPool(ephemeral=(32768, 60999))
    http = [pool.http_port() for _ in range(10)]
    nccl = [pool.nccl_port() for _ in range(10)]
    every = http + [p + GRPC_PORT_OFFSET for p in http] + nccl
    assert len(set(every)) == 30 and all(20000 <= p < 32768 for p in every)
    # a range with no room below it: any port the versions allow, still distinct
    wide = PortPool(ephemeral=(1024, 65535))
    ports = [wide.http_port() for _ in range(5)] + [wide.nccl_port() for _ in range(5)]
    assert len(set(ports)) == 10 and all(20000 <= p <= 65535 for p in ports)
    tiny = PortPool(low=32760, ephemeral=(32768, 60999))  # no room: the wide fallback
    assert tiny.http == (32760, 65535 - GRPC_PORT_OFFSET)


def test_two_emulated_servers_given_one_nccl_port_fail_as_sglang_does(tmp_path: Path) -> None:
    """The emulator listens on --nccl-port as SGLang's torch.distributed store does: the second
    server of a shared port exits with EADDRINUSE before serving."""
    launcher = EmulatedLauncher("0.5.14", {"prefill_s": 0.001, "baseline_step_s": 0.001})
    pool = PortPool()
    nccl = pool.nccl_port()
    first = launch(launcher, LaunchSpec("/m", pool.http_port(), nccl_port=nccl), tmp_path / "a.log")
    try:
        with httpx.Client(trust_env=False) as client:
            wait_healthy(first, client, timeout_s=30, poll_s=0.05)
            second = launch(launcher, LaunchSpec("/m", pool.http_port(), nccl_port=nccl), tmp_path / "b.log")
            try:
                with pytest.raises(ServerStartError, match="exited with code 1"):
                    wait_healthy(second, client, timeout_s=30, poll_s=0.05)
                assert f"port: {nccl}, useIpv6: false, code: -98, name: EADDRINUSE" in second.log_text()
            finally:
                second.stop()
    finally:
        first.stop()
