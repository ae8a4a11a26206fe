"""Run-folder keys written by one stage and read by others (and by `eaglescale status`), in a
module with no heavy imports so the status command can name them without loading torch."""

DISCOVERY_MARKER = "prompts/_SUCCESS.json"  # discovery's commit: the prompt tables' sha256s and rows
DISCOVERY_REPORT = "prompts/discovery_report.json"  # discovery's counts, filtered and quarantined rows
SHARD_PLAN = "prompts/shards.json"  # shard id -> prompt-id range (written once, reused)
SYNTHESIS_STAGE = "synthesize"  # a synthesized source's shards: journal, data, markers (tasks/synthesize/)
SYNTHESIS_PLAN = "synthesize/plan.json"  # per synthesized source: its synthesis hash and shard size
GENERATE_PROGRESS = "generate/progress.json"  # generation's counts, throughput, heartbeat
TRAIN_VOCAB_MAP = "train/vocab_map.safetensors"  # d2t / t2d of the draft vocabulary
TRAIN_PLOT = "train/plots/accuracy.png"  # held-out accuracy per draft position over steps
TRAIN_CHECKPOINTS = "train/checkpoints"  # step-N/ folders, each valid once its meta.json exists
TRAIN_BEST = "train/best.json"  # the best evaluated checkpoint
TRAIN_RESULT = "train/result.json"  # the training run's summary
TRAIN_DATA = "train/data.json"  # the states trained on: offline/online, hidden size, aux ids, splits
TRAIN_FINAL = "train/final"  # the exported SGLang EAGLE3 draft
TRAIN_FINAL_SPECULATORS = "train/final-speculators"  # the same draft in vLLM's speculators format
GATE_DONE = "gate/_SUCCESS.json"  # the gate's decision and what it was about
GATE_PROGRESS = "gate/progress.json"  # where a running gate is (tasks/gate/progress.py)
PROMOTED = "promoted.json"  # the promoted draft (in the registry and the run folder)
STAGE_CLOCKS = "stages"  # stages/<stage>.json: when each stage started and ended (flows/common.stage_run)
CLOCK_HEARTBEAT_S = 30.0  # a running stage rewrites its clock this often (its heartbeat)


def stage_clock_key(stage: str) -> str:
    return f"{STAGE_CLOCKS}/{stage}.json"
