"""KimiK25Config for the wrapped kimi-k25-mini: the DeepSeek-V3 text config nested as ``text_config``."""

from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING


class KimiK25Config(PretrainedConfig):
    model_type = "kimi_k25"
    sub_configs = {"text_config": AutoConfig}

    def __init__(self, text_config=None, vision_config=None, media_placeholder_token_id=163605, **kwargs):
        if isinstance(text_config, dict):
            text_config = CONFIG_MAPPING[text_config.get("model_type", "deepseek_v3")](**text_config)
        self.text_config = text_config if text_config is not None else CONFIG_MAPPING["deepseek_v3"]()
        self.vision_config = dict(vision_config or {})  # write_wrapped writes every key the stand-in reads
        self.media_placeholder_token_id = media_placeholder_token_id
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
