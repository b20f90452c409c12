"""Objects to bytes and back: pickle protocol 5 with out-of-band tensor buffers, user code by value, remote errors."""
