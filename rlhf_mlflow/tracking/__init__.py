"""The tracking layer: the only code in rlhf_mlflow that imports mlflow."""
