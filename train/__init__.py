"""Training of the shipped demo pair (dev only: needs the `train` extra, i.e. torch)."""
