"""The round: the engines (coordinator, buffered), who gets which task (task_board, registry,
sampling), when a round ends, the final and global evaluations, resume (run_state) and
the virtual clock."""
