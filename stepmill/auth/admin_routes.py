"""Engine routes no agent may call: they change or reveal what the engine serves (weights, caches,
sleep, RPC into its workers). vLLM's exist with ``VLLM_SERVER_DEV_MODE=1`` (and runtime LoRA
updating) and check no key; SGLang's likewise. The proxy refuses them to every caller without the write
token, and a sandboxed run's door to an engine opens onto ``INFERENCE_ROUTES`` alone: only the
trainer, which calls the engine directly, may."""

from __future__ import annotations

ADMIN_ROUTES: frozenset[str] = frozenset((
    # vLLM (VLLM_SERVER_DEV_MODE=1): generation, caches, weights, sleep, RPC, server internals
    "/pause", "/resume", "/is_paused", "/abort_requests", "/collective_rpc",
    "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache",
    "/update_weight_version", "/weight_info", "/weight_checker", "/get_world_size",
    "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine", "/start_weight_update",
    "/start_draft_weight_update", "/update_weights", "/finish_weight_update",
    "/sleep", "/wake_up", "/is_sleeping", "/release_kv_cache_memory", "/server_info",
    "/start_profile", "/stop_profile", "/scale_elastic_ep", "/is_scaling_elastic_ep",
    "/fault_tolerance/apply", "/fault_tolerance/status",
    # vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1
    "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
    # SGLang
    "/update_weights_from_disk", "/update_weights_from_tensor", "/update_weights_from_distributed",
    "/init_weights_update_group", "/destroy_weights_update_group", "/get_weights_by_name",
    "/pause_generation", "/continue_generation", "/flush_cache", "/abort_request",
    "/get_weight_version", "/release_memory_occupation", "/resume_memory_occupation",
    "/load_lora_adapter", "/unload_lora_adapter",
))


# What a sandboxed run's engine door opens onto: inference alone (an allow-list, so an admin route an
# engine adds later is closed by construction). vLLM's OpenAI routes and its token route (what
# stepmill's white-box session calls), its tokenizer routes, SGLang's /generate.
INFERENCE_ROUTES: frozenset[str] = frozenset((
    "/v1/chat/completions", "/v1/completions", "/v1/models", "/inference/v1/generate",
    "/tokenize", "/detokenize", "/generate",
))


def is_admin_route(path: str) -> bool:
    """Whether a request path is an admin route: the query string, a trailing slash, repeated slashes,
    dot segments and percent-encoding (which servers undo before routing) do not hide one."""
    bare = _routed(path)
    return bare in ADMIN_ROUTES or bare.lower() in ADMIN_ROUTES


def is_inference_route(path: str) -> bool:
    """Whether a request path is one of ``INFERENCE_ROUTES``, as the engine would route it."""
    return _routed(path) in INFERENCE_ROUTES


def _routed(path: str) -> str:
    """The path a server routes: the query string, a trailing slash, repeated slashes, dot segments and
    percent-encoding undone."""
    import posixpath
    import urllib.parse

    bare = urllib.parse.unquote(path.split("?", 1)[0].split("#", 1)[0])
    bare = posixpath.normpath("/" + bare.lstrip("/")) if bare else "/"
    return bare.rstrip("/") or "/"
