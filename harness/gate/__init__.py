"""`harness gate`: base and head run in pairs until a sequential test decides (command.py's docstring says
how). One job a module: trees.py (the two sides' code), launching.py (one run of a side, duet placement),
pairs.py (the pairs, recorded and resumed), verdict.py (the verdict and its markdown), command.py (the command
line). Its figures are harness.analyze.paired's, its decision harness.analyze.sequential's."""
