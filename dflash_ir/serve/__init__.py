"""dflash-serve: the llama-server of dflash-ir (OpenAI-compatible HTTP API, streaming, slots,
a chat page, Prometheus metrics). Modules: cli (flags), artifact_cache (-m/-md compile cache),
app (routes), openai_api (request/response shapes), generation (one request's run),
scheduler (slots, queue), slot_state (per-slot state ownership), text (detokenising, stop
strings), reasoning (<think> split), metrics, static/ (the chat page), ray_serve (--ray:
replicas on Ray Serve), relay (a request carried to a replica's app and back)."""
