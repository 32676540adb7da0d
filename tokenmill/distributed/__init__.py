"""Model parallelism beneath the layers: which rank holds what (`layout`), and the process
groups with their collectives and stage-to-stage transfers (`parallel_state`)."""
