"""distrun-mlflow: params, metrics, the loss plot and the status of a run in MLflow (rank 0)."""
