"""Prompts the target writes itself (a discover source of kind synthesized), before discovery.

plan.py     the slots of each synthesized source: ids, request ids and seeds from (source, index),
            shards of slots (planned once, in synthesize/plan.json)
stage.py    `SynthesisStage`: the slots' shards through the generation stage's own shard protocol
            (tasks/generate/shard.py: leases, journal, commit, exactly once), and
            `discover_with_synthesis`, the discover stage with its synthesis first
read.py     what the synthesis committed, read back (verified) as discovery's SynthesizedSet

Above tasks/discover and tasks/generate, which it composes: discovery takes the synthesized
requests as data and never imports this package.
"""
