"""An OpenAI-compatible HTTP API (chat, completions, embeddings, rerank, score, tokenize) in front of a
running tritonserver, which it calls over gRPC. It never loads model weights: only tokenizers and chat
templates, read from the checkpoints the models' `config.pbtxt` files name."""
