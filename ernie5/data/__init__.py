"""Data access: the data root, readers for the real text datasets, and seeded procedural problems.

Modules: :mod:`ernie5.data.root` (finding the root, :class:`DataMissing`), :mod:`ernie5.data.text`
(one reader per dataset, :class:`DataCorrupt`), :mod:`ernie5.data.procedural` (generators shared by
the eval tasks and the pretraining mixture).
"""

from ernie5.data.root import DataMissing, require_file, resolve_data_dir

__all__ = ["DataMissing", "require_file", "resolve_data_dir"]
