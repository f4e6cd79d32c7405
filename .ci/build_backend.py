"""setuptools' own build backend, without its information-only notice on editable installs.

stepmill maps addon/, store/ and trainer_bridge/ to stepmill.* through ``package-dir`` on purpose,
so setuptools always installs it in editable mode through an import finder and prints a notice
("be careful with folders ... with the same name as your package") on every ``pip install -e .``.
Those folders refuse to load under their bare names, so the notice has nothing to act on; every
other warning (deprecations, packaging errors) still shows.
"""

import warnings

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403 (the backend's hooks, unchanged)
from setuptools.warnings import InformationOnly


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InformationOnly)
        return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
