"""One module per method: its config and its selection policy."""
