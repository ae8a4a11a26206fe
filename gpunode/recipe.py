"""The "recipe" plan (issue 27's A/B of the training recipe, plans.PLANS): the variants trained
side by side, each online in its own run root; the run's root extracted beside them and
SpecForge's draft trained on it from the default variant's vocabulary map (or an earlier
session's carried in, `prepare --anchor-from`: neither extracted nor trained); every draft
replayed (`node recipe-replay`); the gate of the default variant with every other draft a
challenger; the best of ours and SpecForge's packed to come back (`node drafts K`)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from gpunode import node_env
from gpunode.node_env import read_json
from gpunode.plans import (
    RECIPE_EXTRACT,
    RECIPE_GATE,
    RECIPE_ROOT,
    RECIPE_VARIANTS,
    contender_name,
    recipe_gate_sets,
)
from gpunode.training import specforge_command
from gpunode.travel import carried_anchor, pack_parts


def link_run(src: Path, dest: Path, folders: list[str]) -> None:
    """A run root beside `src` holding its run.json (a copy) and `folders` (hard links), once:
    committed files are never rewritten in place (every write is a new file renamed over)."""
    if (dest / "run.json").is_file():
        return
    dest.mkdir(parents=True, exist_ok=True)
    for name in folders:
        subprocess.run(["cp", "-al", str(src / name), str(dest / name)], check=True)
    shutil.copyfile(src / "run.json", dest / "run.json")


class RecipePlan:
    def recipe(self) -> None:
        """The "recipe" plan: the variants and SpecForge's draft, the replay, the gate, the pack."""
        self.setup()
        self.write_params()
        self.generate_once(reference=False)  # a rehearsal's small run generates
        env = self.trainer_env()
        roots = {name: node_env.NODE / f"{RECIPE_ROOT}{name}" for name in self.variants}
        self.save_measure("recipe", {"variants": {n: list(RECIPE_VARIANTS[n]) for n in self.variants},
                                     "extract": RECIPE_EXTRACT, "gate": list(RECIPE_GATE)})  # fmt: skip
        threads = [threading.Thread(target=self.optional, args=(functools.partial(self.train_variant, name, env),
                                                                 f"train-{name}"), daemon=True)
                   for name in roots if not self.done_before(f"train-{name}")]  # fmt: skip
        began = time.time()
        for thread in threads:
            thread.start()
        specforge = self._anchor(env, roots["default"] / "train/vocab_map.safetensors", threads)
        for thread in threads:
            thread.join()
        self.save_measure("recipe_train_s", time.time() - began)
        finals = {n: r / "train/final" for n, r in roots.items() if (r / "train/final/config.json").is_file()}
        if "default" not in finals:
            raise RuntimeError("the default variant exported no draft: no candidate to gate (logs/stage-train-default.log)")
        self.note("replay", "running")  # ours, while SpecForge trains on
        self.optional(lambda: self.py(node_env.node_step("recipe-replay"), "replay"), "replay", mark=True)
        if specforge:
            codes = self.finish_specforge(specforge[0], env, time.time() - began)
            self.save_measure("specforge_exit", codes)
            self.note("specforge", "done" if not any(codes.values()) else "failed-part", json.dumps(codes))
        if (node_env.NODE / "specforge/draft/config.json").is_file():
            finals["specforge"] = node_env.NODE / "specforge/draft"
            self.note("replay-specforge", "running")
            self.optional(lambda: self.py(node_env.node_step("recipe-replay"), "replay"), "replay-specforge", mark=True)
        challengers = {n: path for n, path in finals.items() if n != "default"}
        if not self.done_before("gate"):  # a failed gate still leaves the replay and the drafts to bring back
            self.optional(lambda: self.stage("gate", *recipe_gate_sets(challengers), *self.emulated, run_root=roots["default"]),
                          "gate")  # fmt: skip
        self.optional(lambda: self.pack_drafts(finals, roots["default"]), "drafts", mark=True)

    def _anchor(self, env: dict[str, str], vocab: Path, threads: list[threading.Thread]) -> list[subprocess.Popen[bytes]]:
        """SpecForge's draft: an earlier session's, on these sequences, gated again (neither
        extracted nor trained), or trained here (start_anchor; a failure costs the anchor, not
        ours); its process, if one was started."""
        specforge: list[subprocess.Popen[bytes]] = []
        anchor = carried_anchor()
        if anchor is not None:
            shutil.copytree(anchor, node_env.NODE / "specforge/draft", dirs_exist_ok=True)
            self.note("anchor", "done", f"carried: {anchor} (prepare --anchor-from)")
        elif "anchor" not in self.skip:
            self.optional(lambda: specforge.extend(self.start_anchor(env, vocab, threads)), "anchor")
        return specforge

    def train_variant(self, name: str, env: dict[str, str]) -> None:
        """Recipe variant `name` trained online in its own run root (NODE/recipe-NAME, the run's
        prompts and generation shared by hard links), at the plan's settings and its own."""
        root = node_env.NODE / f"{RECIPE_ROOT}{name}"
        link_run(self.run_root, root, ["prompts", "generate"])
        self.stage("train", "train.hidden_states=online", *RECIPE_VARIANTS[name], label=f"train-{name}", env=env,
                   run_root=root)  # fmt: skip

    def recipe_variant(self, name: str) -> int:
        """`node recipe-variant NAME`: once the recipe plan is done and device time is left, one
        more variant trained alone on the same run (train_variant) and replayed beside the
        plan's drafts (`node recipe-replay`), not gated. Into $OUT, what `recipe_ab_report.py
        --after` reads: recipe-replay.json and recipe-NAME/train/ (result, best, plot), with the
        train log's tail."""
        finished = "finished" in ((read_json(node_env.NODE / "status.json") or {}).get("steps") or {})
        if self.plan != "recipe" or not finished or name not in RECIPE_VARIANTS:
            print(f"node recipe-variant {name}: it follows a finished recipe plan on this machine (plan {self.plan}, "
                  f"finished: {finished}) and names one of {', '.join(RECIPE_VARIANTS)}", file=sys.stderr)  # fmt: skip
            return 2
        self.train_variant(name, self.trainer_env())
        self.py(node_env.node_step("recipe-replay"), f"replay-{name}")
        out, train = node_env.out_dir() / f"after-{name}", node_env.NODE / f"{RECIPE_ROOT}{name}/train"
        (out / f"{RECIPE_ROOT}{name}/train/plots").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(node_env.NODE / "recipe-replay.json", out / "recipe-replay.json")
        for rel in ("result.json", "best.json", "plots/accuracy.png"):
            if (train / rel).is_file():
                shutil.copyfile(train / rel, out / f"{RECIPE_ROOT}{name}/train/{rel}")
        log = node_env.NODE / f"logs/stage-train-{name}.log"
        if log.is_file():  # where results.tar.gz keeps the plan's: the report times the loop from it
            (out / "logs").mkdir(exist_ok=True)
            (out / f"logs/stage-train-{name}.log").write_bytes(log.read_bytes()[-200_000:])
        self.status["state"] = "done"  # the machine's plan is done again (`node wait` reads it)
        self._write_status()
        print(f"node recipe-variant {name}: trained and replayed; {out}")
        return 0

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
        if node_env.REHEARSAL or (node_env.NODE / "specforge/specforge_train.json").is_file():
            return []
        (node_env.NODE / "specforge.stop").unlink(missing_ok=True)
        self.note("specforge", "running")
        return [self.py(specforge_command(), "specforge", env, wait=False)]

    def pack_drafts(self, finals: dict[str, Path], gated: Path) -> None:
        """The best of our variants (by the gate's accept length, else the replay's) and
        SpecForge's draft when it trained here, as drafts.tar in parts under NODE/drafts, with
        index.json (the drafts, the parts, the whole's sha256): what `node drafts K` returns."""
        ours = {n: p for n, p in finals.items() if n != "specforge"}
        measured = {contender_name(c["name"]): c["accept_length"]
                    for c in ((read_json(gated / "gate/report.json") or {}).get("decision") or {}).get("contenders", [])
                    if c.get("accept_length") is not None}  # fmt: skip
        replayed = {n: r["overall"]["3"]["accept_length"] for n, r in (read_json(node_env.NODE / "recipe-replay.json") or {}).items()
                    if (r.get("overall") or {}).get("3", {}).get("accept_length") is not None}  # fmt: skip
        by = measured if any(n in measured for n in ours) else replayed
        best = max(ours, key=lambda n: by.get(n, float("-inf")))
        trained_here = "specforge" in finals and carried_anchor() is None  # a carried one is on this machine already
        chosen = {best: ours[best], **({"specforge": finals["specforge"]} if trained_here else {})}
        index = pack_parts(chosen, {"drafts": {n: str(p) for n, p in chosen.items()},
                                    "best_by": "gate" if by is measured else "replay", "accept_lengths": by})  # fmt: skip
        self.save_measure("drafts", index)
