"""Lets vLLM's LLaVA model import without torchvision, which has no build for the CPU torch here.

vLLM's ``llava.py`` imports ``pixtral.py``, which takes ``_num_image_tokens`` from transformers'
``image_processing_pixtral``, a module that imports torchvision at its top. Its torchvision-free twin,
``image_processing_pil_pixtral``, defines the same function and is served under that name instead.
It acts only where torchvision is missing. It lives on ``PYTHONPATH`` (``sitecustomize``) because vLLM
imports the model in processes of its own: a registry-inspection subprocess and the engine core.
Only the tiny multimodal e2e test puts it there (tests/e2e/tinyvlm.py).
"""

import importlib
import importlib.abc
import importlib.util
import sys

_WANTED = "transformers.models.pixtral.image_processing_pixtral"
_TWIN = "transformers.models.pixtral.image_processing_pil_pixtral"


class _Twin(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201 - the finder protocol
        if name != _WANTED or importlib.util.find_spec("torchvision") is not None:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):  # noqa: ANN001, ANN201
        return importlib.import_module(_TWIN)

    def exec_module(self, module):  # noqa: ANN001, ANN201
        pass


sys.meta_path.insert(0, _Twin())
