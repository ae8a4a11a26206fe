"""Run-folder keys written by one stage and read by others (and by `eaglescale status`), in a
module with no heavy imports so the status command can name them without loading torch."""

TRAIN_BEST = "train/best.json"  # the best evaluated checkpoint
TRAIN_RESULT = "train/result.json"  # the training run's summary
TRAIN_FINAL = "train/final"  # the exported SGLang EAGLE3 draft
TRAIN_FINAL_SPECULATORS = "train/final-speculators"  # the same draft in vLLM's speculators format
GATE_DONE = "gate/_SUCCESS.json"  # the gate's decision and what it was about
GATE_PROGRESS = "gate/progress.json"  # where a running gate is (tasks/gate/progress.py)
PROMOTED = "promoted.json"  # the promoted draft (in the registry and the run folder)
