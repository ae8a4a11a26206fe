"""The SGLang launch-command builder, per pinned version, and the emulator that takes its flags."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tasks.gate.config import GateConfig
from tasks.gate.launch import (
    LaunchError,
    LaunchSpec,
    SpecParams,
    build_launch_command,
    build_server_args,
    flag_set,
    resolve_spec,
)
from tasks.gate.server import (
    EmulatedLauncher,
    check_server_info,
    fetch_server_info,
    free_port,
    launch,
    parse_server_log,
    wait_healthy,
)

ROOT = Path(__file__).resolve().parents[1]
SPEC = SpecParams("/drafts/d1", num_steps=3, topk=1, num_draft_tokens=4)


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


def test_versions_are_pinned() -> None:
    assert flag_set("v0.5.4.post1").version == "0.5.4"
    assert flag_set("0.5.23rc1").version == "0.5.23"
    with pytest.raises(LaunchError, match=r"'0\.5\.9' is not pinned.*\['0\.5\.4', '0\.5\.23'\]"):
        flag_set("0.5.9")
    with pytest.raises(ValueError, match="sglang_version"):
        GateConfig(sglang_version="0.4.0")


def test_extra_args_may_not_carry_foreign_or_managed_flags() -> None:
    with pytest.raises(LaunchError, match=r"--cuda-graph-max-bs is not an SGLang 0\.5\.23 flag"):
        build_server_args(LaunchSpec("/m", 30000, extra_args=("--cuda-graph-max-bs", "8")), "0.5.23")
    with pytest.raises(LaunchError, match=r"--disable-decode-cuda-graph is not an SGLang 0\.5\.4 flag"):
        build_server_args(LaunchSpec("/m", 30000, extra_args=("--disable-decode-cuda-graph",)), "0.5.4")
    with pytest.raises(LaunchError, match="--speculative-num-steps is set by the gate itself"):
        build_server_args(LaunchSpec("/m", 30000, extra_args=("--speculative-num-steps=2",)), "0.5.23")
    ok = build_server_args(LaunchSpec("/m", 30000, extra_args=("--attention-backend", "fa3")), "0.5.23")
    assert ok[-2:] == ["--attention-backend", "fa3"]


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


@pytest.mark.parametrize("version", ["0.5.4", "0.5.23"])
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
    assert info[{"0.5.4": "cuda_graph_max_bs", "0.5.23": "cuda_graph_max_bs_decode"}[version]] == 4
    assert info["eaglescale_env"] == {"NCCL_ALGO": "Ring"}
    assert not server.alive()


def test_the_emulator_rejects_the_old_flag_on_0_5_23() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tasks.engines.sglang_spec_launch", "--sim-config-json", '{"sglang_version": "0.5.23"}',
         "--model-path", "/m", "--cuda-graph-max-bs", "8"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "unrecognized arguments: --cuda-graph-max-bs 8" in proc.stderr


def test_server_info_check_catches_sglangs_silent_adjustment(tmp_path: Path) -> None:
    """Bypassing the builder's guard: SGLang (emulated) forces draft tokens to steps+1 and the
    server-info check names the difference."""
    spec = LaunchSpec("/m", free_port(), spec=SPEC)
    launcher = EmulatedLauncher("0.5.23")
    args = build_server_args(spec, "0.5.23")
    args[args.index("--speculative-num-draft-tokens") + 1] = "6"
    launcher.command = lambda _spec: [sys.executable, "-m", "tasks.engines.sglang_spec_launch",  # type: ignore[method-assign]
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
