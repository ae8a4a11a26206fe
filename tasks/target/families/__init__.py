"""Everything eaglescale knows about each target family, one module per family
(docs/TARGETS.md lists them and says how to add one).

base.py        the per-family interface: `TargetFamily` and its parts (GGUF spec, static forward)
registry.py    the families by config.json's model_type (`family_for`, `find_family`, ...), read
               from the modules its FAMILY_MODULES names
<family>.py    one family each, exporting FAMILIES

Nothing is re-exported here, and no family module imports torch or transformers: the registry
is read by tasks/target/model_dir.py, which the configuration's input check reaches.
"""
