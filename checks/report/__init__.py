"""The report: the compatibility table, decisions, advice, estimates, launch flags."""
