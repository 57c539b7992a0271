"""Tests of the tooling around the runtime: repository rendering, the tritonserver launcher."""
