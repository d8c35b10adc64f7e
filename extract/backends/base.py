"""The interface every target backend (Hugging Face, SGLang) implements.

The extraction pipeline only talks to this interface, so a backend is a thin adapter:
it turns token ids into captured auxiliary hidden states plus the teacher's next-token
distribution, and prompts into generated token ids.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

TEACHER_KINDS = ("topk", "last_hidden")


@dataclass(frozen=True)
class TeacherSpec:
    """What to keep of the target's next-token distribution.

    kinds: any of "topk" (top-k log-probabilities with their ids) and "last_hidden"
    (the post-final-norm hidden state; the trainer re-applies the target's lm_head).
    chunk_tokens bounds memory: logits are never materialised for more than this many
    tokens at once, whatever the vocabulary size.
    """

    kinds: tuple[str, ...] = ("topk",)
    topk: int = 64
    chunk_tokens: int = 512

    def __post_init__(self) -> None:
        bad = [k for k in self.kinds if k not in TEACHER_KINDS]
        if bad or not self.kinds:
            raise ValueError(f"teacher kinds must be a non-empty subset of {TEACHER_KINDS}, got {self.kinds}")
        if self.topk < 1:
            raise ValueError(f"topk must be >= 1, got {self.topk}")


@dataclass(frozen=True)
class GenerationConfig:
    """How the target regenerates assistant turns (recorded in the manifest)."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int = 0
    batch_size: int = 8

    def to_manifest(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_new_tokens": self.max_new_tokens,
            "seed": self.seed,
        }


@dataclass
class Captured:
    """Features of one sequence of T tokens, on CPU.

    aux_hidden: [T, n_aux * H] float32, the captured layers concatenated in ascending
    layer order. topk_*: [T, K] (ids int64, log-softmax over the full vocab, descending).
    last_hidden: [T, H] float32, post-final-norm.
    """

    aux_hidden: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    last_hidden: torch.Tensor | None = None


@dataclass(frozen=True)
class TargetInfo:
    """Facts about the target that the dataset manifest and the drafter config need."""

    name: str  # what the user asked for: a built-in name or a path
    path: str  # the resolved local folder holding config.json and the weights
    architecture: str  # e.g. "LlamaForCausalLM", "KimiK25ForConditionalGeneration"
    text_architecture: str  # the decoder's own architecture, e.g. "DeepseekV3ForCausalLM"
    model_type: str  # of the text config, e.g. "llama", "deepseek_v3", "kimi_k2"
    config_hash: str  # sha256 of the canonical JSON of config.json
    hidden_size: int
    num_layers: int
    vocab_size: int
    aux_layer_ids: tuple[int, ...]  # redraft convention, see redraft.core.layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: dict[str, Any] = field(default_factory=dict)  # rope_theta and rope_scaling, as the target has them
    embed_key: str = "model.embed_tokens.weight"  # key of the input embedding in the weight files
    lm_head_key: str = "lm_head.weight"  # key of the output head (may equal embed_key when tied)


class TargetBackend(ABC):
    """A loaded target model. Implementations: extract.backends.hf, extract.backends.sglang."""

    info: TargetInfo
    tokenizer: Any

    @abstractmethod
    def capture(self, batch: list[list[int]], teacher: TeacherSpec) -> list[Captured]:
        """One forward pass per sequence (batched), returning the captured features of each."""

    def capture_batches(self, batches: Iterable[list[list[int]]], teacher: TeacherSpec) -> Iterator[list[Captured]]:
        """Each batch's features, in order. This default captures them one after the other; a backend whose
        engine runs in processes of its own overrides it to let the engine work on the next batch while this
        process turns the current one into features (``extract.backends.vllm``)."""
        for batch in batches:
            yield self.capture(batch, teacher)

    @abstractmethod
    def generate(self, prompts: list[list[int]], gen: GenerationConfig, stop_ids: list[int],
                 seeds: list[int] | None = None) -> list[list[int]]:
        """Continue each prompt; return only the new token ids, ending with a stop id when one was produced.

        ``seeds``: one per prompt where the engine seeds each request (SGLang); otherwise the batch is
        sampled from one generator seeded with ``gen.seed``, its rows drawing in turn.
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release engine resources (SGLang processes); a no-op by default."""
