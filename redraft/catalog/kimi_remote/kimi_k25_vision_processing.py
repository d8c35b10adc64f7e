"""KimiK25VisionProcessor for the wrapped kimi-k25-mini: the image processor a Kimi-K2.5 checkpoint names in its
``preprocessor_config.json`` (``auto_map.AutoImageProcessor``).

Engines read its NaViT budget, ``media_proc_cfg`` (SGLang's kimi_k25 processor takes patch size, merge kernel,
patch limits, mean and std from it), and ask it how many ``<|media_pad|>`` tokens an image becomes. The
miniature's vision tower is an untrained stand-in, so pixels are never turned into patches here: a request that
carries an image is refused by name instead of being answered with noise.
"""

import math

from transformers.image_processing_utils import BaseImageProcessor


class KimiK25VisionProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values", "grid_thws"]

    def __init__(self, media_proc_cfg=None, **kwargs):
        super().__init__(**kwargs)
        self.media_proc_cfg = dict(media_proc_cfg or {})

    def media_tokens_calculator(self, media):
        """Placeholder tokens for one image: its size fitted into the patch budget, merged merge_kernel x
        merge_kernel (the count an engine expands ``<|media_pad|>`` to)."""
        cfg = self.media_proc_cfg
        patch, merge = int(cfg["patch_size"]), int(cfg["merge_kernel_size"])
        if cfg.get("fixed_output_tokens") is not None:
            return int(cfg["fixed_output_tokens"])
        width, height = media["image"].size
        side = int(cfg["patch_limit_on_one_side"]) * patch
        scale = min(1.0, math.sqrt(int(cfg["in_patch_limit"]) / (max(1, width // patch) * max(1, height // patch))),
                    side / width, side / height)
        unit = patch * merge
        w, h = min(max(1, int(width * scale)), side), min(max(1, int(height * scale)), side)
        return math.ceil(w / unit) * math.ceil(h / unit)

    def preprocess(self, medias, **kwargs):
        raise NotImplementedError(
            "kimi-k25-mini is a text model in Kimi-K2.5's served layout: its vision tower is an untrained "
            "stand-in, so it takes no images")
