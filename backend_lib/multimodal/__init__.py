"""Inputs beside text: bounded image decoding and image sources, shared by the LLM, the encoders
and the frontend."""
