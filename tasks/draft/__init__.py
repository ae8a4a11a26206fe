"""The EAGLE-3 draft: model, vocabulary map, training-time-test trainer, checkpoints, export."""
