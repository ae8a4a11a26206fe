"""The target model as eaglescale knows it: where its folder is, its tokenizer, its identity.

path_kinds.py    what a model_path / chat_template string is (a hub id, template text); imports nothing
packages.py      `package://<import name>/<path>`: a file inside an installed Python package
errors.py        TargetError (imports nothing)
families/        what eaglescale knows about each target family, one module per family, and the
                 registry keyed by model_type (docs/TARGETS.md)
gguf_convert.py  a `.gguf` file of a family with a GGUF spec -> a cached bf16 HF folder (our
                 converter, deterministic)
multipart.py     `multipart://<spec>`: a file shipped in parts inside several packages, assembled
                 once into the cache with its sha256 checked (specs shipped in known/)
model_dir.py     `resolve_model_dir` (every loader's way to the folder), the folder's config.json
tokenizer.py     the tokenizer (read once per process), prompt rendering and token counts
identity.py      the target's part of the run fingerprint (`target_identity`)
tiny.py          the tiny random-weight Llama target (`eaglescale tiny-target`, `make tiny-target`)

Nothing is re-exported here: importing one module (the configuration reads path_kinds and
packages) must not import transformers or torch through this file.
"""
