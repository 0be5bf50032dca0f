"""Runtime: the engine, its scheduler and executors, the graph runner, and the model components they run."""
