"""kvfleet's benchmarks: each public module is a program, run from the repository root as
``.venv/bin/python -m bench.<name> [--help]``; the ``_``-prefixed modules are their shared helpers
(``from bench import _common``). Results go to ``bench/results/`` (docs/BENCHMARKS.md)."""
