"""KimiK25ForConditionalGeneration for the wrapped kimi-k25-mini: the text model under ``language_model``
(weights ``language_model.model.*``, ``language_model.lm_head.weight``) and a vision stand-in
(``vision_tower.*``, ``mm_projector.*``) that text never runs through."""

from torch import nn
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel

from .configuration_kimi_k25 import KimiK25Config


class PatchEmbedStandin(nn.Module):
    def __init__(self, hidden: int, patch: int) -> None:
        super().__init__()
        self.proj = nn.Linear(3 * patch * patch, hidden, bias=False)


class VisionTowerStandin(nn.Module):
    def __init__(self, vision: dict) -> None:
        super().__init__()
        self.patch_embed = PatchEmbedStandin(int(vision["vt_hidden_size"]), int(vision["patch_size"]))


class ProjectorStandin(nn.Module):
    def __init__(self, vision: dict, text_hidden: int) -> None:
        super().__init__()
        kh, kw = vision["merge_kernel_size"]
        merged = int(vision["vt_hidden_size"]) * int(kh) * int(kw)
        self.proj = nn.Sequential(nn.Linear(merged, merged, bias=False), nn.GELU(),
                                  nn.Linear(merged, text_hidden, bias=False))


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
