"""Encoder models (embedding, rerank) on token-budget micro-batching over a packed BERT encoder.

A Triton `execute` call's requests go to `EmbeddingService` or `RerankService` (service.py): each
request is read and tokenized on its own (tokenization.py; a bad request fails alone), then the
items of all good requests are computed together by `Embedder.embed` (embedder.py) or a reranker's
`score` (reranker.py: cross-encoder logits or bi-encoder cosine similarity). batching.py sorts the
items by length and packs them into micro-batches bounded by padded tokens and item count;
packed_tokens.py lays each micro-batch end to end without padding, packed_bert.py (with
attention.py and the weights read by weights.py) computes the hidden states, and pooling.py
(modes from the checkpoint's sentence-transformers files, st_config.py) or the classifier head
turns them into vectors or scores, returned to each request in order. config.py holds the
settings of both models. An embedding model in sparse mode (SPLADE) puts a masked-LM head and
vocabulary-wide pooling (sparse.py) where pooling.py would be, and answers nonzero ids and weights.
An embedding model on a CLIP or SigLIP checkpoint (image_text.py) embeds texts and images into one
space with the checkpoint's own transformers towers, images preprocessed as their request arrives.
"""
