"""steps: one module per MLproject entry point, the only place a step meets MLflow (through tracking/)."""
