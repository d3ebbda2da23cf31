"""Registers peft_sparse's PEFT types as soon as ``peft`` is imported, so ``PeftModel.from_pretrained``,
``PeftConfig.from_pretrained`` and ``AutoPeftModel*.from_pretrained`` load sparse adapters without
``import peft_sparse``. Installed with the package as ``peft_sparse_autoload.pth``, which imports this module
at interpreter start-up: it only puts a small finder on ``sys.meta_path`` (no torch, no peft, no package
import) that, once ``peft`` has finished importing, imports ``peft_sparse``. ``PEFT_SPARSE_AUTOLOAD=0``
turns it off.
"""

import os
import sys

_ENV = "PEFT_SPARSE_AUTOLOAD"


class _AfterPeft:
    """A meta-path finder that wraps ``peft``'s loader: after peft executes, peft_sparse registers its types."""

    def find_spec(self, name, path=None, target=None):
        if name != "peft":
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding this finder again
        import importlib.util

        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            try:
                import peft_sparse  # noqa: F401  (registers the sparse PEFT types)
            except Exception as error:  # noqa: BLE001  (never break `import peft`; the user can import it by hand)
                import warnings

                warnings.warn(f"peft_sparse could not register its PEFT types automatically ({error!r}); import peft_sparse first")

        loader.exec_module = exec_then_register
        return spec


def install() -> None:
    if os.environ.get(_ENV, "1").lower() in ("0", "false", "no", "off"):
        return
    if "peft" in sys.modules:  # peft came first (e.g. imported by sitecustomize): register now
        return
    if not any(isinstance(f, _AfterPeft) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterPeft())


install()
