"""What a run leaves behind: the run directory (run_directory), the round's record
(run_recorder), the byte ledger (accounting), the console text (console_text) and the
Prometheus endpoint (metrics)."""
