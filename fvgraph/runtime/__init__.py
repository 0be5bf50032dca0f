"""Runtime: the scheduler and executors, the graph runner, request slots and the eager projection cache."""
