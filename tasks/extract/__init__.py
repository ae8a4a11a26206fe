"""Stage `extract`: training sequences from committed generation rows, the target's hidden
states for them (the three aux layers an EAGLE-3 draft is fed, and the final normed state),
stored per shard under the run folder's commit protocol.

Modules: sequences (rows -> token ids + loss mask + split), capture (layer-id convention,
backend interface), sizes (bytes a token costs, no torch), storage (safetensors format, reader
API), forecast (disk), stage (plain stage code), sglang_capture (GPU-node backend). The local backend is
tasks.extract.local_capture.
"""
