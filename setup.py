"""Everything is in pyproject.toml; this only puts peft_sparse_autoload.pth at the top of site-packages (a .pth file
lies outside any package, which pyproject metadata cannot express), for wheels and editable installs alike."""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "peft_sparse_autoload.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        source = os.path.join(os.path.dirname(os.path.abspath(__file__)), PTH)
        shutil.copy(source, os.path.join(self.build_lib, PTH))
        if getattr(self, "editable_mode", False):  # an editable wheel takes only what lands in its install_lib
            target = self.distribution.get_command_obj("install").install_lib
            if target:
                shutil.copy(source, os.path.join(target, PTH))

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
