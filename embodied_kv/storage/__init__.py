"""KV storage: the static arena and the plan of one packed step (below model/)."""
