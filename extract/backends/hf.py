"""Hugging Face transformers target: capture aux layers + teacher with forward hooks, and generate.

One forward of the decoder stack per batch (never the CausalLM, so no full-vocab logits), with hooks
on exactly the aux layers. The teacher is computed from the post-final-norm state in chunks.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from extract.backends.base import Captured, GenerationConfig, TargetBackend, TargetInfo, TeacherSpec
from extract.model_layout import align_latent_norm_eps, find_decoder_layers, find_lm_head, find_text_model
from extract.teacher import topk_per_sequence
from redraft.core import layers
from redraft.core.target_weights import text_config, weight_key_candidates

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def config_hash(path: str | Path) -> str:
    """sha256 of the canonical JSON (sorted keys, no whitespace) of a config.json file."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    canon = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()


def weight_file_keys(folder: str | Path) -> set[str]:
    """Tensor names stored in a model folder: from the safetensors index, else from each file's header."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object")
        return set(weight_map)
    keys: set[str] = set()
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            keys.update(f.keys())
    return keys


def resolve_weight_keys(config: Any, keys: set[str]) -> tuple[str, str]:
    """Pick the (embed, lm_head) keys present in ``keys`` from weight_key_candidates."""
    embed_cands, head_cands = weight_key_candidates(config)
    embed = next((k for k in embed_cands if k in keys), None)
    head = next((k for k in head_cands if k in keys), None)
    if embed is None or head is None:
        missing = "input embedding" if embed is None else "lm_head"
        cands = embed_cands if embed is None else head_cands
        raise ValueError(f"cannot find the {missing} weight among the target's weight keys; tried {cands}")
    return embed, head


def _text_architecture(model: nn.Module, text_cfg: Any, architecture: str) -> str:
    archs = getattr(text_cfg, "architectures", None)
    if archs:
        return archs[0]
    inner = getattr(model, "language_model", None)
    if isinstance(inner, nn.Module) and hasattr(inner, "lm_head"):
        return type(inner).__name__
    name = type(find_text_model(model)).__name__
    return name[: -len("Model")] + "ForCausalLM" if name.endswith("Model") else architecture


def rope_info(text_cfg: Any) -> dict[str, Any]:
    """rope_theta plus the scaling dict, as the config has them (transformers 5 keeps rope_parameters)."""
    params = getattr(text_cfg, "rope_parameters", None)
    scaling = getattr(text_cfg, "rope_scaling", None)
    theta = getattr(text_cfg, "rope_theta", None)
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
    out: dict[str, Any] = {}
    if theta is not None:
        out["rope_theta"] = float(theta)
    if isinstance(params, dict):
        out["rope_parameters"] = dict(params)
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        out["rope_scaling"] = dict(scaling)
    return out


def _first_tensor(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"decoder layer returned {type(output).__name__}; expected a tensor or a tuple starting with one")


class _AuxHooks:
    """Forward hooks on the aux decoder layers that copy each one's output into one [B, W, n_aux * H] buffer, at
    ``offset`` along the sequence (a chunked capture moves it; ``length``: the buffer's width, default the first
    output's). Used as a context manager: the hooks are removed on exit; ``tensor()`` checks that every hook fired."""

    def __init__(self, decoder_layers: Any, ids: list[int], length: int | None) -> None:
        self.decoder_layers, self.ids, self.length = decoder_layers, ids, length
        self.offset = 0
        self.buffer: torch.Tensor | None = None
        self.filled: set[int] = set()
        self.handles: list[Any] = []

    def _hook_for(self, k: int) -> Any:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            h = _first_tensor(output)
            width = h.shape[-1]
            if self.buffer is None:
                shape = (*h.shape[:-2], self.length or h.shape[-2], len(self.ids) * width)
                self.buffer = h.new_empty(shape)
            self.buffer[..., self.offset : self.offset + h.shape[-2], k * width : (k + 1) * width].copy_(h)
            self.filled.add(k)

        return hook

    def __enter__(self) -> _AuxHooks:
        self.handles = [self.decoder_layers[i].register_forward_hook(self._hook_for(k)) for k, i in enumerate(self.ids)]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()

    def tensor(self) -> torch.Tensor:
        missing = [i for k, i in enumerate(self.ids) if k not in self.filled]
        if missing or self.buffer is None:
            raise RuntimeError(f"forward hooks on decoder layers {missing or self.ids} never fired")
        return self.buffer


class HFTarget(TargetBackend):
    """A target loaded with ``AutoModelForCausalLM`` from a local folder (never the hub)."""

    def __init__(
        self,
        path: str,
        *,
        name: str | None = None,
        aux_layer_ids: Sequence[int] | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        trust_remote_code: bool = False,
        attn_implementation: str = "sdpa",
        chunk_tokens: int = 0,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = Path(path).expanduser()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{folder}: not a local model folder (no config.json); redraft never downloads")
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
        self.device = torch.device(device)
        self.chunk_tokens = int(chunk_tokens)  # a longer sample is captured in chunks through the KV cache (0: never)
        self.tokenizer = AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=trust_remote_code
        )
        self.model = AutoModelForCausalLM.from_pretrained(
            str(folder),
            dtype=_DTYPES[dtype],
            trust_remote_code=trust_remote_code,
            local_files_only=True,
            attn_implementation=attn_implementation,
        )
        self.model.to(self.device).eval()

        config = self.model.config
        text_cfg = text_config(config)
        for key in ("final_logit_softcapping", "logit_scale"):
            if getattr(text_cfg, key, None) not in (None, 1.0):
                raise ValueError(f"{folder}/config.json: {key}={getattr(text_cfg, key)} is not supported by the teacher")
        self.text_model = find_text_model(self.model)
        self.decoder_layers = find_decoder_layers(self.model)
        self.lm_head = find_lm_head(self.model)
        num_layers = int(text_cfg.num_hidden_layers)
        if len(self.decoder_layers) != num_layers:
            raise ValueError(f"config says {num_layers} layers but the model has {len(self.decoder_layers)}")
        eps = float(getattr(text_cfg, "rms_norm_eps", 1e-6))
        if align_latent_norm_eps(self.decoder_layers, eps):
            log.info("MLA latent norms (q_a/kv_a_layernorm) set to rms_norm_eps=%g, as vLLM and SGLang serve them "
                     "(transformers fixes them at 1e-6)", eps)
        architecture = (getattr(config, "architectures", None) or [type(self.model).__name__])[0]
        ids = layers.default_aux_layer_ids(num_layers, architecture) if aux_layer_ids is None else aux_layer_ids
        ids = layers.validate_aux_layer_ids(ids, num_layers)
        layers.check_servable(ids, architecture, num_layers)

        disk_keys = weight_file_keys(folder)
        if not disk_keys:
            log.warning("%s: no safetensors files; resolving embed/lm_head keys from the loaded model", folder)
            disk_keys = set(self.model.state_dict())
        embed_key, lm_head_key = resolve_weight_keys(config, disk_keys)

        heads = int(text_cfg.num_attention_heads)
        hidden = int(text_cfg.hidden_size)
        architectures = getattr(config, "architectures", None) or [type(self.model).__name__]
        self.info = TargetInfo(
            name=name or str(path),
            path=str(folder.resolve()),
            architecture=architectures[0],
            text_architecture=_text_architecture(self.model, text_cfg, architectures[0]),
            model_type=str(text_cfg.model_type),
            config_hash=config_hash(folder / "config.json"),
            hidden_size=hidden,
            num_layers=num_layers,
            vocab_size=int(text_cfg.vocab_size),
            aux_layer_ids=tuple(ids),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(text_cfg, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(text_cfg, "head_dim", None) or hidden // heads),
            intermediate_size=int(text_cfg.intermediate_size),
            rms_norm_eps=float(getattr(text_cfg, "rms_norm_eps", 1e-6)),
            max_position_embeddings=int(text_cfg.max_position_embeddings),
            rope=rope_info(text_cfg),
            embed_key=embed_key,
            lm_head_key=lm_head_key,
        )
        log.info("loaded %s (%s, %d layers), aux layers %s", self.info.name, self.info.architecture, num_layers, ids)

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        if pad is None:
            raise ValueError(f"{self.info.path}: tokenizer has neither a pad nor an eos token")
        return int(pad)

    def capture(self, batch: list[list[int]], teacher: TeacherSpec) -> list[Captured]:
        """One right-padded forward of the decoder stack; hooks copy the aux layers' outputs into one buffer.

        Memory: the aux states exist once, in a [B, W, n_aux*H] buffer the hooks fill as the forward passes
        each layer (no per-layer copies kept, no concatenation), and on CPU in float32 each sample's
        ``aux_hidden`` is a view of its rows there, so a batch's features cost one copy of them. A batch wider
        than ``chunk_tokens`` is captured one sample at a time, each in chunks through the KV cache.
        """
        if not batch:
            return []
        lengths = [len(seq) for seq in batch]
        if min(lengths) < 1:
            raise ValueError(f"empty sequence at batch index {lengths.index(0)}")
        if 0 < self.chunk_tokens < max(lengths):
            return [c for seq in batch for c in self._capture_one(seq, teacher)]
        width = max(lengths)
        input_ids = torch.full((len(batch), width), self._pad_id(), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, seq in enumerate(batch):
            input_ids[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = 1
        with self._aux_hooks() as aux, torch.inference_mode():
            out = self.text_model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                                  use_cache=False)
            final = out[0] if isinstance(out, tuple) else out.last_hidden_state
            del out
            return self._split(aux.tensor(), final, lengths, teacher)

    def _capture_one(self, seq: list[int], teacher: TeacherSpec) -> list[Captured]:
        """One sample in chunks of ``chunk_tokens`` through the KV cache: each chunk's aux states and final states
        go into the sample's buffers at its offset, as one pass would have written them."""
        from transformers import DynamicCache

        ids = torch.as_tensor([seq], dtype=torch.long, device=self.device)
        finals: list[torch.Tensor] = []
        cache = DynamicCache()
        with self._aux_hooks(len(seq)) as aux, torch.inference_mode():
            for a in range(0, len(seq), self.chunk_tokens):
                aux.offset = a
                out = self.text_model(input_ids=ids[:, a : a + self.chunk_tokens], past_key_values=cache,
                                      use_cache=True)
                finals.append(out[0] if isinstance(out, tuple) else out.last_hidden_state)
                del out
            return self._split(aux.tensor(), torch.cat(finals, dim=1), [len(seq)], teacher)

    def _aux_hooks(self, length: int | None = None) -> _AuxHooks:
        return _AuxHooks(self.decoder_layers, list(self.info.aux_layer_ids), length)

    def _split(self, aux: torch.Tensor, final: torch.Tensor, lengths: list[int], teacher: TeacherSpec) -> list[Captured]:
        """Trim padding, run the chunked teacher on the real tokens only, and move to CPU float32."""
        rows = [final[b, :n] for b, n in enumerate(lengths)]
        topk_ids: list[torch.Tensor] | None = None
        topk_lp: list[torch.Tensor] | None = None
        if "topk" in teacher.kinds:
            topk_ids, topk_lp = topk_per_sequence(torch.cat(rows), lengths, self.lm_head.weight, teacher.topk,
                                                  teacher.chunk_tokens, getattr(self.lm_head, "bias", None))
        out = []
        for b, n in enumerate(lengths):
            out.append(
                Captured(
                    # a view of the batch buffer when it already is CPU float32, else a copy
                    aux_hidden=aux[b, :n].to("cpu", torch.float32),
                    topk_ids=topk_ids[b] if topk_ids is not None else None,
                    topk_logprobs=topk_lp[b] if topk_lp is not None else None,
                    last_hidden=rows[b].to("cpu", torch.float32).clone() if "last_hidden" in teacher.kinds else None,
                )
            )
        return out

    def generate(self, prompts: list[list[int]], gen: GenerationConfig, stop_ids: list[int],
                 seeds: list[int] | None = None) -> list[list[int]]:
        """Batched left-padded greedy/sampled continuation; each result is cut after its first stop id.

        One generator seeded with ``gen.seed`` samples the whole batch (rows draw in turn), so ``seeds``
        is not used: the same prompts in the same batches reproduce.
        """
        from transformers import GenerationConfig as HFGenerationConfig

        if not prompts:
            return []
        if min(len(p) for p in prompts) < 1:
            raise ValueError("cannot generate from an empty prompt")
        pad = self._pad_id()
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            input_ids[row, width - len(p) :] = torch.as_tensor(p, dtype=torch.long)
            mask[row, width - len(p) :] = 1
        # Every knob is explicit: eos [] keeps the model's own generation_config eos from stopping early,
        # and top_k=0 switches off transformers' default top-k of 50 when sampling.
        knobs: dict[str, Any] = {"do_sample": False}
        if gen.temperature > 0:
            knobs = {"do_sample": True, "temperature": gen.temperature, "top_p": gen.top_p, "top_k": 0}
        hf_gen = HFGenerationConfig(
            max_new_tokens=gen.max_new_tokens,
            min_new_tokens=0,
            num_beams=1,
            repetition_penalty=1.0,
            eos_token_id=list(stop_ids),
            pad_token_id=pad,
            **knobs,
        )
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.inference_mode():
            torch.manual_seed(gen.seed)
            seqs = self.model.generate(
                input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device), generation_config=hf_gen
            )
        stops = set(stop_ids)
        results = []
        for row in seqs[:, width:].tolist():
            cut = next((j + 1 for j, t in enumerate(row) if t in stops), len(row))
            results.append(row[:cut])
        return results
