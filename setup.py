"""Package discovery for the two mapped trees (metadata lives in pyproject.toml).

client/ installs as ``layertap`` and server/ as ``layertap.server``. setuptools'
``packages.find`` cannot rename a tree, so this finds every subpackage under
each one; a new subpackage can never be left out of the wheel.
"""

from setuptools import find_packages, setup


def _under(root: str, name: str) -> list[str]:
    return [name, *(f"{name}.{sub}" for sub in find_packages(root))]


setup(packages=_under("client", "layertap") + _under("server", "layertap.server"))
