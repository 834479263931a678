"""Analysis of records: derived figures, tables, reports, the regression gate, baselines, history."""
