"""The server that scripts/serve.py runs: OpenAI's chat-completions API and the chat page, around one model.

protocol.py is the wire format (the request schema, the response bodies and chunks), errors.py OpenAI's error
shape, served_model.py the loaded model and its engine, completion.py one request on that engine, replies.py its
generated ids read back as content, reasoning and tool calls (whole or as stream deltas), streaming.py its
server-sent events, builtin_tools.py the library's tools offered to clients' tool loops (/tools), and app.py the
FastAPI application and its routes.
"""
