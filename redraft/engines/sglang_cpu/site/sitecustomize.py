"""Run at start-up by every Python process of the SGLang CPU venv that redraft starts (this folder is on its
``PYTHONPATH``): lets the package index's torchvision import beside the CPU build of torch.

The index serves only CUDA builds of torchvision; beside a CPU torch their compiled ops (``torchvision/_C.so``)
cannot load, which torchvision allows for (``torchvision.extension._has_ops()`` is then False) except in one place:
``torchvision/_meta_registrations.py`` registers fake kernels for ``torchvision::nms`` and ``torchvision::qnms``
unconditionally, and that fails when the ops were never declared ("operator torchvision::nms does not exist").
SGLang imports ``torchvision.transforms`` on its engine's import path (``sglang/srt/multimodal/internvl_utils.py``)
and never calls torchvision's compiled ops for a text model.

So, the first time anything imports torchvision, and only when its compiled ops cannot load: the two op
*schemas* are declared, exactly as torchvision's own C++ declares them, with no kernel behind them. torchvision
is not modified; calling ``torchvision.ops.nms`` still fails loudly (no CPU kernel), as it would have.

And one more for the MLA drafter: SGLang's ``Eagle3DeepseekV2ForCausalLM`` (``srt/models/kimi_k25_eagle3.py``)
ends ``set_embed`` and ``set_embed_and_head`` with ``torch.cuda.synchronize()``, which raises on a torch built
without CUDA ("Torch not compiled with CUDA enabled"); the EAGLE worker calls ``set_embed`` for every EAGLE-3
drafter. When that module is imported in a process whose torch has no CUDA, ``torch.cuda.synchronize`` becomes
what it means there: waiting for no device work (no-op). Nothing changes where CUDA exists.
"""

import importlib.abc
import sys

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


def declare_missing_torchvision_ops(package_dir: str) -> bool:
    """Declare the schemas torchvision's import needs when its ``_C`` cannot load; True when it did."""
    import glob
    import os

    import torch

    libraries = glob.glob(os.path.join(package_dir, "_C*.so"))
    try:
        for path in libraries:
            torch.ops.load_library(path)
        if libraries:
            return False  # a torchvision built for this torch: nothing to do
    except OSError:
        pass
    library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SCHEMAS.values():
        library.define(schema)
    sys.modules[__name__]._torchvision_library = library  # keep the registrations alive
    return True


class _TorchvisionHook(importlib.abc.MetaPathFinder):
    """Steps in once, at the first ``import torchvision``, then gets out of the way."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(fullname, path)
        if spec is not None and spec.submodule_search_locations:
            declare_missing_torchvision_ops(list(spec.submodule_search_locations)[0])
        return spec


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` once ``name`` has been imported (its own loader does the import)."""

    def __init__(self, name, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader, then = spec.loader, self.then

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                then(module)

        spec.loader = _Loader()
        return spec


def cpu_cuda_synchronize(module=None) -> bool:
    """``torch.cuda.synchronize`` as a no-op when this torch has no CUDA (nothing to wait for); True when it did."""
    import torch

    if torch.backends.cuda.is_built():
        return False
    torch.cuda.synchronize = lambda device=None: None
    return True


sys.meta_path.insert(0, _TorchvisionHook())
sys.meta_path.insert(0, _AfterImport("sglang.srt.models.kimi_k25_eagle3", cpu_cuda_synchronize))
