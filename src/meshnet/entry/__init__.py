"""The entry node's side of the activation plane: routes, hops, the pipeline, generation."""
