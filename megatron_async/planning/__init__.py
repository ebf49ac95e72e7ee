"""Planning a cluster run before it starts: memory per GPU, held sends, tied-embedding timing."""
