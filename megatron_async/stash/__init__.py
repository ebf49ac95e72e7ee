"""The weight stash: two weight versions per stage, and the state a checkpoint carries for them."""
