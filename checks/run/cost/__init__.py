"""What a run costs before it starts: the cost model and its packaged prior (``model``), and the fit of a pass
into a time budget (``budget``)."""
