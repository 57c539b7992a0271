"""OpenAI's Responses API (`/v1/responses`), translated over the chat-completions pipeline."""
