"""``python -m dilocox.config``: print the config reference (``python -m dilocox.config > docs/CONFIG.md``)."""

from dilocox.config.reference import reference_markdown

print(reference_markdown())
