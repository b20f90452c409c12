"""Bytes: framing and limits, the handshake, credentials and TLS, compression, control frames, receive buffers.

Nothing here pickles; the layers above hand this one bytes."""
