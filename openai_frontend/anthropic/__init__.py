"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as a translation
over the chat-completions pipeline (routes/chat.py's `create` and `create_stream`)."""
