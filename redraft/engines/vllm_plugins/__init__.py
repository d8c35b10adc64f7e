"""Code that vLLM loads by module path inside its own processes (stdlib, vLLM, torch, safetensors only)."""
