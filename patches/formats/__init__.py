"""Numbers as the reports print them; no torch import, so the commands that only read a report start at once."""
