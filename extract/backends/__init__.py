"""Target backends: the model that is being served, run to capture features and regenerate answers."""
