"""KimiK25ForConditionalGeneration for the wrapped kimi-k25-mini: the text model under ``language_model``
(weights ``language_model.model.*``, ``language_model.lm_head.weight``) and a vision stand-in that text never runs
through. The stand-in holds Kimi-K2.5's vision parameters by their checkpoint names and shapes (MoonViT's patch
embedding, position embedding, encoder blocks, final norm; the patch-merger projector), at the sizes
``vision_config`` gives, so an engine that builds the real tower (SGLang's kimi_k25.py) loads them by name."""

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel

from .configuration_kimi_k25 import KimiK25Config


class PatchEmbedStandin(nn.Module):
    def __init__(self, vision: dict) -> None:
        super().__init__()
        vt, patch = int(vision["vt_hidden_size"]), int(vision["patch_size"])
        self.proj = nn.Conv2d(3, vt, kernel_size=patch, stride=patch)
        self.pos_emb = nn.Module()
        self.pos_emb.weight = nn.Parameter(
            torch.zeros(int(vision["init_pos_emb_height"]), int(vision["init_pos_emb_width"]), vt))


class BlockStandin(nn.Module):
    def __init__(self, vt: int, mlp: int) -> None:
        super().__init__()
        self.norm0, self.norm1 = nn.LayerNorm(vt), nn.LayerNorm(vt)
        self.wqkv, self.wo = nn.Linear(vt, 3 * vt), nn.Linear(vt, vt)
        self.mlp = nn.Module()
        self.mlp.fc0, self.mlp.fc1 = nn.Linear(vt, mlp), nn.Linear(mlp, vt)


class EncoderStandin(nn.Module):
    def __init__(self, vision: dict) -> None:
        super().__init__()
        vt = int(vision["vt_hidden_size"])
        self.blocks = nn.ModuleList(BlockStandin(vt, int(vision["vt_intermediate_size"]))
                                    for _ in range(int(vision["vt_num_hidden_layers"])))
        self.final_layernorm = nn.LayerNorm(vt)


class VisionTowerStandin(nn.Module):
    def __init__(self, vision: dict) -> None:
        super().__init__()
        self.patch_embed = PatchEmbedStandin(vision)
        self.encoder = EncoderStandin(vision)


class ProjectorStandin(nn.Module):
    def __init__(self, vision: dict, text_hidden: int) -> None:
        super().__init__()
        kh, kw = vision["merge_kernel_size"]
        vt = int(vision["vt_hidden_size"])
        merged = vt * int(kh) * int(kw)
        self.pre_norm = nn.LayerNorm(vt)
        self.proj = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, text_hidden))


class KimiK25ForConditionalGeneration(PreTrainedModel, GenerationMixin):
    config_class = KimiK25Config
    base_model_prefix = ""
    _supports_sdpa = True
    _supports_attention_backend = True

    def __init__(self, config: KimiK25Config) -> None:
        super().__init__(config)
        self.vision_tower = VisionTowerStandin(config.vision_config)
        self.mm_projector = ProjectorStandin(config.vision_config, config.text_config.hidden_size)
        self.language_model = AutoModelForCausalLM.from_config(config.text_config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.language_model.get_output_embeddings()

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        return self.language_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
