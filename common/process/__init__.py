"""What every process needs: log lines and the live display (console), open-file and core
limits (limits), exit codes and orderly stops (exit_codes), tensor files on disk
(checkpoint) and the run's records as types (records)."""
