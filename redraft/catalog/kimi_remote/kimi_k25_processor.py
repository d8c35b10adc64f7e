"""KimiK25Processor for the wrapped kimi-k25-mini: the processor a Kimi-K2.5 checkpoint names in its
``preprocessor_config.json`` (``auto_map.AutoProcessor``), loaded with ``trust_remote_code``.

It pairs the tokenizer with the image processor and exposes the latter as ``media_processor``, the name engines
read (SGLang's kimi_k25 processor takes ``media_processor.media_proc_cfg`` while it starts). Text goes through
the tokenizer; images are refused by the image processor (the miniature's vision tower is a stand-in).
"""

from transformers.processing_utils import ProcessorMixin


class KimiK25Processor(ProcessorMixin):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, chat_template=chat_template)

    @property
    def media_processor(self):
        return self.image_processor

    def __call__(self, text=None, medias=None, return_tensors=None, **kwargs):
        if medias:
            self.image_processor.preprocess(medias)
        return self.tokenizer(text, return_tensors=return_tensors, **kwargs)
