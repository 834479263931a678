"""`harness select`: which stack and settings for this model on that cluster (docs/selection.md).

It sits above both the predictor and the runner: every candidate is priced by harness.predict, which launches
nothing, and only the confirmation launches `harness run` (as a child, the way a user would), so that the
predictor's "runs nothing" holds by its own imports and this package's one module that runs things is named:

    command.py          the verb: its flags, the answer, the selection record
      search.py         the candidates, priced, constrained, their Pareto front and odds  -> harness.predict
      presentation.py   the rows, tables, documents and the answer's first lines
      confirmation.py   the top candidates run here briefly                                -> harness run
"""
