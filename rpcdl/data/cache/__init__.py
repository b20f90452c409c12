"""Caching a dataset's samples: in process memory or in redis."""
