"""`python -m evals.benchmarks`: print the README's benchmark table (generated from the specs)."""

from evals.benchmarks import markdown_table

print(markdown_table())
