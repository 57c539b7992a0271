"""Tests of the modules every model shares: configuration, request-tensor reading, metrics."""
