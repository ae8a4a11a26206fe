"""The target's error type, alone in a module that imports only the common base
(tasks/errors.py, which imports nothing): the family registry
(tasks/target/families/registry.py) raises a TargetError too, and model_dir.py, which asks the
registry, re-exports it, so `tasks.target.model_dir.TargetError` stays what callers catch."""

from __future__ import annotations

from tasks.errors import ExpectedFailure


class TargetError(ValueError, ExpectedFailure):
    """The target model folder, its tokenizer or a prompt cannot be used; says which and why."""
