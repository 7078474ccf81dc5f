"""The training loop's strategies, one room each."""
