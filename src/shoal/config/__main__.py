"""``python -m shoal.config``: print the knobs table of docs/knobs.md from the declarations."""

from shoal.config import knobs_table

print(knobs_table())
